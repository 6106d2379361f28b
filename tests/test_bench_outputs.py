"""benchmarks/outputs.py and the benchmarks that use it: every script with a `--json` (or `--plot`) output refuses a
path whose folder does not exist in one line, before it imports jax or torch or times anything, and its JSON is
written whole or not at all (a write cut off midway leaves the earlier result as it was)."""
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


@pytest.mark.parametrize("script,flag", OUTPUTS)
def test_an_output_without_a_folder_is_refused_before_any_work(script, flag, heavy_stand_ins):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [heavy_stand_ins, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, os.path.join("benchmarks", script), *REQUIRED.get(script, []),
                           flag, MISSING], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0, done.stdout[-1000:]
    assert done.stderr.splitlines() == [f"error: no folder for {flag} {MISSING!r}, {flag}, create the folder or name "
                                        "another"], done.stderr[-2000:]
    assert not done.stdout


def test_the_benchmarks_write_their_json_through_the_helper():
    for script in {s for s, _ in OUTPUTS}:
        text = source(script)
        assert "write_json(" in text and "json.dump(" not in text, script


def test_the_helpers_import_only_the_standard_library():
    tree = ast.parse(source("outputs.py"))
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "json", "os", "sys"}, imported


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
    data = {"ratio": 1.25, "per_round": [1.0, 2.5], "name": "torch ÷ ours", "ci95": None, "nested": {"a": [1, {}]}}
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
