"""benchmarks/bench_allocator.py: the speed ratio is taken within each round, a failed job drops only its round,
and a machine without glibc's malloc tunables is refused before any process is started."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_allocator as B  # noqa: E402  pylint: disable=wrong-import-position


def job(step_ms, faults=0.0, rss=1000.0, mean=None):
    return {"step_ms": step_ms, "mean_step_ms": step_ms if mean is None else mean, "minor_faults_per_step": faults,
            "user_s_per_step": 0.5, "sys_s_per_step": 0.05,
            "max_rss_mb": rss}


def test_the_ratio_is_the_launchers_step_over_the_variants_in_each_round():
    launcher, kept = f"{B.LAUNCHER} @20", f"{B.KEPT} @20"
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
    launcher, kept = f"{B.LAUNCHER} @128", f"{B.KEPT} @128"
    jobs, ratios = B.summary([{launcher: job(300.0), kept: {"error": ["x"]}}] * 2, [128])
    assert set(jobs) == {launcher} and ratios == {}


@pytest.mark.parametrize("libc,platform_name,mode", [(("", ""), "linux", "madvise"),
                                                      (("glibc", "2.31"), "linux", "madvise"),
                                                      (("glibc", "2.39"), "darwin", "madvise"),
                                                      (("glibc", "2.39"), "linux", "never")])
def test_a_machine_without_the_tunables_is_refused(monkeypatch, libc, platform_name, mode):
    monkeypatch.setattr(B.platform, "libc_ver", lambda: libc)
    monkeypatch.setattr(B.sys, "platform", platform_name)
    monkeypatch.setattr(B.allocator, "thp_mode", lambda: mode)
    with pytest.raises(SystemExit, match=r"^error: the variants are glibc malloc tunables with transparent huge "
                                         r"pages, this is .*, run on Linux with glibc 2.35 or later and huge pages "
                                         r"not 'never'$"):
        B.refuse_without_tunables()


def test_glibc_235_on_linux_is_accepted(monkeypatch):
    monkeypatch.setattr(B.platform, "libc_ver", lambda: ("glibc", "2.35"))
    monkeypatch.setattr(B.sys, "platform", "linux")
    monkeypatch.setattr(B.allocator, "thp_mode", lambda: "madvise")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    B.refuse_without_tunables()
