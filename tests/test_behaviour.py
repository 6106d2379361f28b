"""Behaviour is unchanged by refactors: the loops reproduce `tests/data/behaviour.json` (recorded before the
trainer / run-folder redesign; see tests/behaviour.py) — 20-step float32 losses and final parameters of every
scheme in both families and of a GLUE fine-tune, bitwise on a stack (versions and CPU kind) a recording was
made on, to 1e-5 relative elsewhere."""
import numpy as np
import pytest

from tests import behaviour as B
from tupe_jax.positional import SCHEMES

RECORDINGS = B.recordings()
PRIMARY = RECORDINGS[0]


def check(kind: str, got: dict, recordings: list = RECORDINGS) -> None:
    same = [r for r in recordings if r["stack"] == got["stack"]]
    for name, result in got[kind].items():
        if same:                              # recorded on this stack: every bit must match
            assert result == same[0][kind][name], f"{kind} {name} changed (same stack {got['stack']})"
        else:                                 # another XLA or CPU may round differently; the numbers must not move
            assert B.agrees(result, PRIMARY[kind][name]), f"{kind} {name} moved beyond 1e-5 of the primary"


def test_golden_covers_every_scheme_and_family():
    for recording in RECORDINGS:
        assert set(recording["pretrain"]) == {f"{pe}-{o}" for pe in SCHEMES for o in B.OBJECTIVES}, (
            f"a recording in tests/data/ ({recording['stack']}) does not hold every scheme of tupe_jax/positional "
            "in both families (a scheme was added or removed): re-record with `python tests/behaviour.py --write` "
            "(about 5 min on 2 cores), then `python tests/behaviour.py --add-fast`")
        assert set(recording["finetune"]) == set(PRIMARY["finetune"])
        assert all(len(r["losses"]) == B.STEPS for r in recording["pretrain"].values())
        # what is pinned is training: every scheme's recorded loss falls (first 5 steps' mean to the last 5's)
        for name, r in recording["pretrain"].items():
            assert sum(r["losses"][:5]) / 5 - sum(r["losses"][-5:]) / 5 > 0.3, f"{name}: {r['losses']}"
        # the fingerprint discriminates: schemes that train differently have different parameters
        assert len({r["params"]["sha256"] for r in recording["pretrain"].values()}) == len(recording["pretrain"])


def test_every_recording_has_its_own_stack_and_the_primarys_numbers():
    stacks = [r["stack"] for r in RECORDINGS]
    assert all("cpu" in s for s in stacks) and all(stacks.count(s) == 1 for s in stacks)
    for recording in RECORDINGS[1:]:
        assert B.recording_path(recording["stack"]) != B.GOLDEN
        for kind in ("pretrain", "finetune"):
            for name, result in recording[kind].items():
                assert B.agrees(result, PRIMARY[kind][name]), f"{recording['stack']['cpu']}: {name} moved"


def test_agrees_is_relative_to_1e5():
    want = {"losses": [2.0, 1.0], "params": {"abs_sum": 100.0}}
    assert B.agrees({"losses": [2.0 * (1 + 9e-6), 1.0], "params": {"abs_sum": 100.0}}, want)
    assert not B.agrees({"losses": [2.0 * (1 + 2e-5), 1.0], "params": {"abs_sum": 100.0}}, want)
    assert not B.agrees({"losses": [2.0], "params": {"abs_sum": 100.0}}, want)
    assert not B.agrees({"losses": [2.0, 1.0], "params": {"abs_sum": 100.01}}, want)


def test_two_schemes_and_a_finetune_reproduce_the_golden_run(tmp_path):
    got = B.record_at(str(tmp_path), schemes=("tupe_r",), objectives=("mlm", "clm"), finetune=True)
    assert got["stack"]["compile"] == "default"     # the bitwise link to the recording made before the redesign
    check("pretrain", got)
    check("finetune", got)


@pytest.mark.slow
def test_every_scheme_reproduces_the_golden_run(tmp_path):
    """At the suite's fast compile: bitwise where this CPU kind has a fast-compile recording (itself within 1e-5 of
    the primary, `--add-fast`), to 1e-5 of the primary elsewhere."""
    schemes = tuple(s for s in B.SCHEMES if s != "tupe_r")
    got = B.record_at(str(tmp_path), schemes=schemes, finetune=False, compile="fast")
    assert got["stack"]["compile"] == "fast"
    check("pretrain", got)


def test_a_fast_compile_recording_is_compared_bitwise():
    fast = B.json.loads(B.json.dumps(PRIMARY))
    fast["stack"] = {**PRIMARY["stack"], "compile": "fast"}
    got = B.json.loads(B.json.dumps(fast))
    check("pretrain", got, recordings=[PRIMARY, fast])
    loss = np.float32(got["pretrain"]["rope-clm"]["losses"][7])
    got["pretrain"]["rope-clm"]["losses"][7] = float(np.nextafter(loss, np.float32(9)))
    with pytest.raises(AssertionError, match="rope-clm changed"):   # one float32 step: within 1e-5, still a change
        check("pretrain", got, recordings=[PRIMARY, fast])
    check("pretrain", got, recordings=[PRIMARY])                    # no recording of its stack: 1e-5 of the primary


def _fake_golden(tmp_path, monkeypatch, result: dict):
    """behaviour.main against a copy of the primary recording in tmp_path, `record` returning `result`."""
    golden = tmp_path / "behaviour.json"
    golden.write_text(B.json.dumps(PRIMARY), encoding="utf-8")
    monkeypatch.setattr(B, "GOLDEN", str(golden))
    monkeypatch.setattr(B, "record", lambda root: result)
    return golden


def _on_another_cpu(moved: float = 0.0) -> dict:
    result = B.json.loads(B.json.dumps(PRIMARY))
    result["stack"] = {**PRIMARY["stack"], "cpu": "x86_64 SomeVendor avx2"}
    result["pretrain"]["bert_a-mlm"]["losses"][3] *= 1 + moved
    return result


def test_add_writes_the_recording_of_another_cpu_kind(tmp_path, monkeypatch):
    golden = _fake_golden(tmp_path, monkeypatch, _on_another_cpu(moved=1e-7))
    monkeypatch.setattr(B, "stack", lambda: _on_another_cpu()["stack"])
    before = golden.read_bytes()
    B.main(["behaviour.py", "--add"])
    assert golden.read_bytes() == before
    added = tmp_path / "behaviour-x86-64-somevendor-avx2.json"
    assert B.json.loads(added.read_text())["stack"]["cpu"] == "x86_64 SomeVendor avx2"
    assert len(B.recordings()) == 2


def test_add_fast_records_at_the_suites_fast_compile_beside_the_primary(tmp_path, monkeypatch):
    result = B.json.loads(B.json.dumps(PRIMARY))
    result["stack"]["compile"] = "fast"
    golden = _fake_golden(tmp_path, monkeypatch, result)
    monkeypatch.setenv("XLA_FLAGS", B.COMPILES["default"])
    flags = []
    monkeypatch.setattr(B, "record", lambda root: flags.append(B.os.environ["XLA_FLAGS"]) or result)
    monkeypatch.setattr(B, "stack", lambda: {**PRIMARY["stack"], "compile": B.compile_kind()})
    before = golden.read_bytes()
    B.main(["behaviour.py", "--add-fast"])
    assert flags == [B.COMPILES["fast"]] and golden.read_bytes() == before
    cpu = B.re.sub(r"[^a-z0-9]+", "-", PRIMARY["stack"]["cpu"].lower())
    added = tmp_path / f"behaviour-{cpu}-fast-compile.json"
    assert B.json.loads(added.read_text())["stack"]["compile"] == "fast"


def test_a_recording_refuses_flags_that_are_neither_compile(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", B.COMPILES["default"] + " --xla_backend_optimization_level=1")
    with pytest.raises(SystemExit, match=r"^error: XLA_FLAGS is .*, unset XLA_FLAGS \(or use record_at\)$"):
        B.record("/nonexistent")


def test_add_refuses_numbers_that_moved_and_writes_nothing(tmp_path, monkeypatch):
    golden = _fake_golden(tmp_path, monkeypatch, _on_another_cpu(moved=1e-4))
    monkeypatch.setattr(B, "stack", lambda: _on_another_cpu()["stack"])
    with pytest.raises(SystemExit, match=r"^error: bert_a-mlm moved beyond 1e-5 .* use --write$"):
        B.main(["behaviour.py", "--add"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [golden.name]


def test_add_on_the_primary_stack_refuses_before_recording(tmp_path, monkeypatch):
    _fake_golden(tmp_path, monkeypatch, None)
    monkeypatch.setattr(B, "stack", lambda: PRIMARY["stack"])
    monkeypatch.setattr(B, "record", lambda root: pytest.fail("recorded"))
    with pytest.raises(SystemExit, match="^error: this stack is the primary recording's"):
        B.main(["behaviour.py", "--add"])


def test_write_replaces_every_recording(tmp_path, monkeypatch):
    golden = _fake_golden(tmp_path, monkeypatch, _on_another_cpu(moved=1e-3))
    (tmp_path / "behaviour-old-kind.json").write_text("{}", encoding="utf-8")
    B.main(["behaviour.py", "--write"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [golden.name]
    assert B.json.loads(golden.read_text())["stack"]["cpu"] == "x86_64 SomeVendor avx2"


def test_a_recording_cut_short_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    result = _on_another_cpu()
    result["pretrain"]["t5-clm"]["losses"] = result["pretrain"]["t5-clm"]["losses"][:1]
    golden = _fake_golden(tmp_path, monkeypatch, result)
    monkeypatch.setattr(B, "stack", lambda: result["stack"])
    before = golden.read_bytes()
    for mode in ("--write", "--add"):
        with pytest.raises(SystemExit, match=r"^error: t5-clm logged fewer than 20 steps, nothing written"):
            B.main(["behaviour.py", mode])
    assert golden.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [golden.name]


def test_add_refuses_a_scheme_the_primary_lacks_before_recording(tmp_path, monkeypatch):
    """A scheme added since the primary was recorded: a KeyError traceback after minutes of recording."""
    golden = _fake_golden(tmp_path, monkeypatch, _on_another_cpu())
    monkeypatch.setattr(B, "stack", lambda: _on_another_cpu()["stack"])
    monkeypatch.setattr(B, "SCHEMES", B.SCHEMES + ("kerple",))
    monkeypatch.setattr(B, "record", lambda root: pytest.fail("recorded"))
    before = golden.read_bytes()
    with pytest.raises(SystemExit, match=r"error: kerple-clm, kerple-mlm not in .*use --write"):
        B.main(["behaviour.py", "--add"])
    assert golden.read_bytes() == before and len(B.recordings()) == 1


def test_write_and_add_fast_record_on_the_suites_dots(tmp_path, monkeypatch):
    """Recorded from a shell, the primary used oneDNN dots, which the suite (TUPE_JAX_ONEDNN=0) never matches bit
    for bit."""
    _fake_golden(tmp_path, monkeypatch, PRIMARY)
    monkeypatch.setenv(B.xla_options.OPT_OUT, "1")
    seen = []
    monkeypatch.setattr(B, "record", lambda root: seen.append(B.os.environ[B.xla_options.OPT_OUT]) or PRIMARY)
    B.main(["behaviour.py", "--write"])
    monkeypatch.setenv(B.xla_options.OPT_OUT, "1")
    fast = B.json.loads(B.json.dumps(PRIMARY))
    fast["stack"]["compile"] = "fast"
    monkeypatch.setattr(B, "record", lambda root: seen.append(B.os.environ[B.xla_options.OPT_OUT]) or fast)
    monkeypatch.setattr(B, "stack", lambda: fast["stack"])
    B.main(["behaviour.py", "--add-fast"])          # the every-scheme test's recording: the suite's dots too
    assert seen == ["0", "0"]
