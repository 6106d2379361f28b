"""benchmarks/bench_allocator.py: the speed ratio is taken within each round, a failed job drops only its round,
a machine where a setting cannot apply is refused before any process is started, and each setting's environment
is what it is named."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_allocator as B  # noqa: E402  pylint: disable=wrong-import-position


def job(step_ms, faults=0.0, rss=1000.0, mean=None):
    return {"step_ms": step_ms, "mean_step_ms": step_ms if mean is None else mean, "minor_faults_per_step": faults,
            "user_s_per_step": 0.5, "sys_s_per_step": 0.05,
            "max_rss_mb": rss}


def test_the_ratio_is_the_bases_step_over_the_variants_in_each_round():
    launcher, kept = f"{B.BASE} @20", f"{B.KEPT} @20"
    rounds = [{launcher: job(300.0, 800), kept: job(250.0, 0, 2000, mean=3000.0)},   # one step stalled for seconds
              {launcher: job(200.0, 900), kept: job(400.0, 0, 2200)},     # a slow round for the variant alone
              {launcher: job(330.0, 700), kept: {"error": ["killed"]}}]   # a failed job: no ratio from its round
    jobs, ratios = B.summary(rounds, [20])
    ratio, by_mean = ratios.values()
    assert ratio["per_round"] == [1.2, 0.5]                 # not the ratio of the medians (265/325)
    assert by_mean["per_round"] == [0.1, 0.5] and "mean step" in list(ratios)[1]
    assert jobs[launcher]["step_ms"]["median"] == 300.0 and jobs[launcher]["minor_faults_per_step"] == 800
    assert jobs[kept]["step_ms"]["per_round"] == [250.0, 400.0] and jobs[kept]["max_rss_mb"] == 2100.0


def test_a_job_failed_in_every_round_has_no_row_and_no_ratio():
    launcher, kept = f"{B.BASE} @128", f"{B.KEPT} @128"
    jobs, ratios = B.summary([{launcher: job(300.0), kept: {"error": ["x"]}}] * 2, [128])
    assert set(jobs) == {launcher} and ratios == {}


def test_each_variant_gets_its_own_ratios():
    rounds = [{f"{label} @20": job(ms) for label, ms in ((B.BASE, 300.0), (B.TBB, 250.0), (B.KEPT, 600.0))}]
    _, ratios = B.summary(rounds, [20], (B.TBB, B.KEPT))
    assert ratios[f"20 slots, median step: {B.TBB} speed / {B.BASE}"]["per_round"] == [1.2]
    assert ratios[f"20 slots, median step: {B.KEPT} speed / {B.BASE}"]["per_round"] == [0.5]


@pytest.mark.parametrize("libc,platform_name,mode,cause", [
    (("", ""), "linux", "madvise", "the C library is not glibc, which has glibc.malloc.hugetlb"),
    (("glibc", "2.31"), "linux", "madvise", "glibc 2.31 has no glibc.malloc.hugetlb (it came in 2.35)"),
    (("glibc", "2.39"), "darwin", "madvise", "this is darwin"),
    (("glibc", "2.39"), "linux", "never", "the kernel's transparent huge pages are 'never'")])
def test_a_machine_where_the_base_cannot_apply_is_refused(monkeypatch, libc, platform_name, mode, cause):
    monkeypatch.setattr(B.platform, "libc_ver", lambda: libc)
    monkeypatch.setattr(B.sys, "platform", platform_name)
    monkeypatch.setattr(B.allocator, "thp_mode", lambda: mode)
    with pytest.raises(SystemExit) as stop:
        B.refuse_unavailable(["kept"])
    assert str(stop.value).startswith(f"error: the hugepages setting cannot apply here ({cause}), the machine, run "
                                      "on Linux with glibc 2.35 or later")


def test_without_the_tbb_wheel_the_tbbmalloc_variant_is_refused(monkeypatch):
    monkeypatch.setattr(B.platform, "libc_ver", lambda: ("glibc", "2.35"))
    monkeypatch.setattr(B.sys, "platform", "linux")
    monkeypatch.setattr(B.allocator, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(B.allocator, "tbbmalloc_libs", lambda: None)
    B.refuse_unavailable(["kept"])                                  # glibc alone: fine
    with pytest.raises(SystemExit, match=r"^error: the tbbmalloc setting cannot apply here \(the tbb wheel"):
        B.refuse_unavailable(["tbbmalloc"])


def test_the_settings_environments_hold_only_their_own_variables(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")      # the caller's shell does not leak in
    monkeypatch.setenv("LD_PRELOAD", "/x/libjemalloc.so")
    monkeypatch.setattr(B.platform, "libc_ver", lambda: ("glibc", "2.35"))
    monkeypatch.setattr(B.allocator, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(B.allocator, "tbbmalloc_libs", lambda: ("/l/libtbbmalloc.so.2", "/l/libtbbmalloc_proxy.so.2"))
    base, tbb, kept = (B.setting_environ(label) for label in (B.BASE, B.TBB, B.KEPT))
    assert base["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and "LD_PRELOAD" not in base
    assert tbb["LD_PRELOAD"] == "/l/libtbbmalloc.so.2:/l/libtbbmalloc_proxy.so.2" and "GLIBC_TUNABLES" not in tbb
    assert tbb["TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD"] == "1048576"
    assert kept["GLIBC_TUNABLES"].startswith("glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0")
    assert all(B.allocator.MARKER not in env for env in (base, tbb, kept))
