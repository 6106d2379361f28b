"""benchmarks/outputs.py and the benchmarks that use it: every script with a `--json` (or `--plot`) output refuses a
path whose folder does not exist, or that is a folder, and counts below what a run needs (zero rounds or steps), in
one line, before it imports jax or torch or times anything; its JSON is written whole or not at all (a write cut
off midway leaves the earlier result as it was) and says where it was made."""
import ast
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
import outputs  # noqa: E402  pylint: disable=wrong-import-position

# What a script needs to get past its argument parsing (required options, positionals); the refusal comes first,
# so none of these is ever read.
REQUIRED = {"bench_import.py": ["--site", "installed"], "bench_prepare.py": ["throughput", "--text", "corpus.txt"],
            "bench_tokenizer_learning.py": ["--text", "corpus.txt"], "pool_runs.py": ["a.json", "b.json"]}
# Stand-ins for the heavy libraries, found before the real ones: a script that imports one before its check fails
# with a traceback instead of the one-line refusal.
HEAVY = ("jax", "jaxlib", "torch", "flax", "numpy")
MISSING = "/no/such/folder/x.json"


def source(name: str) -> str:
    with open(os.path.join(BENCH, name), encoding="utf-8") as f:
        return f.read()


def scripts_with(flag: str) -> list[str]:
    """The benchmarks that take `flag` (an add_argument of it), so a new one is checked without being listed."""
    pattern = re.compile(r'add_argument\(\s*"' + re.escape(flag) + '"')
    return sorted(n for n in os.listdir(BENCH) if n.endswith(".py") and pattern.search(source(n)))


OUTPUTS = [(s, "--json") for s in scripts_with("--json")] + [(s, "--plot") for s in scripts_with("--plot")]


def test_the_scan_finds_the_benchmarks_it_should():
    names = {s for s, _ in OUTPUTS}
    assert {"bench_train.py", "bench_levers.py", "gpu_mfu.py", "pool_runs.py", "triton_registers.py"} <= names
    assert len(names) >= 20 and ("pool_runs.py", "--plot") in OUTPUTS and "outputs.py" not in names


@pytest.fixture(scope="module")
def heavy_stand_ins(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stand_ins")
    for name in HEAVY:
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name} imported before the output check')\n")
    return str(folder)


def run_light(script: str, args: list[str], stand_ins: str) -> subprocess.CompletedProcess:
    """`script` with its required arguments and `args`, the heavy libraries replaced by stand-ins that fail on
    import (a refusal after a heavy import shows as a traceback)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [stand_ins, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, os.path.join("benchmarks", script), *REQUIRED.get(script, []), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("script,flag", OUTPUTS)
def test_an_output_without_a_folder_is_refused_before_any_work(script, flag, heavy_stand_ins):
    done = run_light(script, [flag, MISSING], heavy_stand_ins)
    assert done.returncode != 0, done.stdout[-1000:]
    assert done.stderr.splitlines() == [f"error: no folder for {flag} {MISSING!r}, {flag}, create the folder or name "
                                        "another"], done.stderr[-2000:]
    assert not done.stdout


@pytest.mark.parametrize("script,flag", OUTPUTS)
def test_an_output_that_is_a_folder_is_refused_before_any_work(script, flag, heavy_stand_ins, tmp_path):
    """It passed the folder check and failed at the very end, when the results were written (IsADirectoryError)."""
    done = run_light(script, [flag, str(tmp_path)], heavy_stand_ins)
    assert done.returncode != 0, done.stdout[-1000:]
    assert done.stderr.splitlines() == [f"error: {flag} {str(tmp_path)!r} is a folder, {flag}, name a file (for "
                                        f"example {str(tmp_path / 'result.json')!r})"], done.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def lowest_counts(script: str) -> dict[str, int]:
    """The counts `script` checks with `refuse_below(args, name=lowest, ...)`."""
    call = re.search(r"refuse_below\(args, ([^)]*)\)", source(script))
    return {k.strip(): int(v) for k, v in (kv.split("=") for kv in call.group(1).split(","))} if call else {}


COUNTS = [(s, name, low) for s in sorted({s for s, _ in OUTPUTS}) for name, low in lowest_counts(s).items()]


def test_every_script_with_rounds_or_steps_checks_them():
    for flag in ("--rounds", "--steps", "--reps"):
        for script in scripts_with(flag):
            assert flag[2:] in lowest_counts(script), f"{script} takes {flag} without refuse_below"
    assert ("bench_loop.py", "rounds", 0) in COUNTS and ("bench_train.py", "steps", 1) in COUNTS


@pytest.mark.parametrize("script,name,low", COUNTS)
def test_a_count_below_its_lowest_is_refused_before_any_work(script, name, low, heavy_stand_ins, tmp_path):
    """Zero rounds or steps used to run the heavy part and then fail in a median of nothing, or write a JSON of
    errors with exit status 0."""
    done = run_light(script, [f"--{name}", str(low - 1), "--json", str(tmp_path / "r.json")], heavy_stand_ins)
    assert done.returncode != 0 and os.listdir(tmp_path) == [], done.stdout[-1000:]
    assert done.stderr.splitlines() == [f"error: --{name} {low - 1} is below {low}, --{name}, give {low} or more"], \
        done.stderr[-2000:]


@pytest.mark.parametrize("args,expected", [
    (["--peers", "torch,foo"], "error: unknown peers 'foo', --peers, use some of torch,flax"),
    (["--schemes", "bert_a,nope"], "error: unknown schemes 'nope', --schemes, use some of bert_a,"),
    (["--schemes", "", "--peers", "", "--equal_work", "0", "--loop_steps", "0"], "error: no job to run"),
    (["--allocator", "none", "--allocator_ab", "1"], "error: --allocator_ab 1 needs ours with the launcher's malloc")])
def test_bench_train_refuses_jobs_it_cannot_run_before_any_work(args, expected, heavy_stand_ins):
    """An unknown peer ran the whole benchmark and crashed with a KeyError at the table; an unknown scheme wrote a
    JSON of errors with exit status 0."""
    done = run_light("bench_train.py", args, heavy_stand_ins)
    assert done.returncode != 0 and len(done.stderr.splitlines()) == 1, done.stderr[-2000:]
    assert done.stderr.startswith(expected), done.stderr


def test_the_benchmarks_write_their_json_through_the_helper():
    for script in {s for s, _ in OUTPUTS}:
        text = source(script)
        assert "write_json(" in text and "json.dump(" not in text, script


def test_the_helpers_import_only_the_standard_library():
    tree = ast.parse(source("outputs.py"))
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "importlib", "json", "os", "platform", "shlex", "subprocess", "sys"}, imported


def test_a_result_says_where_it_was_made(tmp_path, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    monkeypatch.setenv("TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD", "1048576")
    monkeypatch.setenv("TUPE_JAX_ALLOCATOR", "tbbmalloc")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(sys, "argv", [os.path.join(BENCH, "bench_x.py"), "--rounds", "3", "--json", "a b.json"])
    outputs.write_json(str(tmp_path / "r.json"), {"ratio": 1.5}, announce=False)
    outputs.write_json(str(tmp_path / "rows.json"), [{"ratio": 1.5}], announce=False)
    made = json.loads((tmp_path / "r.json").read_text())
    env = made["environment"]
    assert made["ratio"] == 1.5 and list(made) == ["ratio", "environment"]
    assert env["command"] == f"python {os.path.relpath(os.path.join(BENCH, 'bench_x.py'))} --rounds 3 --json 'a b.json'"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert env["git_commit"] == (head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
                                 if head.returncode == 0 else None)
    assert env["variables"]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and "XLA_FLAGS" not in env["variables"]
    assert env["variables"]["TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD"] == "1048576"      # the malloc a result ran with
    assert env["variables"]["TUPE_JAX_ALLOCATOR"] == "tbbmalloc"
    assert env["packages"]["jax"] == __import__("jax").__version__ and env["cpu"] and env["python"]
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"ratio": 1.5}]     # a list is written as given


def test_a_job_failed_in_every_round_exits_and_keeps_the_earlier_result(tmp_path):
    with pytest.raises(SystemExit) as stop:
        outputs.refuse_failed({"torch": [["RuntimeError: x"], ["RuntimeError: out of memory"]], "flax": ["y"]},
                              str(tmp_path / "r.json"))
    assert str(stop.value) == ("error: 2 job(s) failed in every round (torch, flax; torch: RuntimeError: out of memory)"
                               f", the benchmark's jobs, see the table above; {tmp_path / 'r.json'} was left as it was")
    outputs.refuse_failed({}, "r.json")                  # nothing failed: nothing happens


def test_unknown_names_are_refused_with_the_known_ones():
    outputs.refuse_unknown("--peers", ["torch"], ("torch", "flax"), "peers")
    with pytest.raises(SystemExit, match=r"^error: unknown peers 'jax', 'x', --peers, use some of torch,flax$"):
        outputs.refuse_unknown("--peers", ["torch", "jax", "x"], ("torch", "flax"), "peers")


def test_missing_folder_names_only_a_path_whose_folder_is_absent(tmp_path):
    assert outputs.missing_folder("") is None                  # the flag not given
    assert outputs.missing_folder("x.json") is None            # the working folder
    assert outputs.missing_folder(str(tmp_path / "x.json")) is None
    assert outputs.missing_folder(str(tmp_path / "no" / "x.png"), "--plot") == (
        f"no folder for --plot {str(tmp_path / 'no' / 'x.png')!r}, --plot, create the folder or name another")
    outputs.refuse_missing_folder("")
    with pytest.raises(SystemExit, match="^error: no folder for --json"):
        outputs.refuse_missing_folder(MISSING)


def test_write_json_writes_what_json_dump_writes(tmp_path, capsys):
    data = {"ratio": 1.25, "per_round": [1.0, 2.5], "name": "torch ÷ ours", "ci95": None, "nested": {"a": [1, {}]},
            "environment": {"given": "by the caller"}}
    with open(tmp_path / "plain.json", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    plain = (tmp_path / "plain.json").read_bytes()
    path = tmp_path / "result.json"
    outputs.write_json(str(path), data)
    assert path.read_bytes() == plain and capsys.readouterr().out == f"wrote {path}\n"
    assert os.stat(path).st_mode == os.stat(tmp_path / "plain.json").st_mode       # the umask's mode, as open()
    outputs.write_json(str(path), data, newline=True, announce=False)
    assert path.read_bytes() == plain + b"\n" and capsys.readouterr().out == ""
    assert sorted(os.listdir(tmp_path)) == ["plain.json", "result.json"]      # no temporary file left


def test_a_write_cut_off_midway_leaves_the_earlier_file_and_no_temporary(tmp_path, monkeypatch, capsys):
    path = tmp_path / "result.json"
    path.write_bytes(b'{\n "earlier": 1\n}')

    def cut_off(data, f, **kwargs):
        f.write('{\n "later": ')
        f.flush()
        raise KeyboardInterrupt        # Ctrl-C, or a timeout's signal, during the write

    with pytest.raises(TypeError):     # json.dump itself stops midway: the partial text is already in the file
        outputs.write_json(str(path), {"later": 2, "unserialisable": object()})
    monkeypatch.setattr(outputs.json, "dump", cut_off)
    with pytest.raises(KeyboardInterrupt):
        outputs.write_json(str(path), {"later": 2})
    assert path.read_bytes() == b'{\n "earlier": 1\n}'
    assert os.listdir(tmp_path) == ["result.json"] and capsys.readouterr().out == ""
