"""Metrics writer (jsonl + TensorBoard), progress line, FLOPs and MFU."""
import io
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from tupe_jax import metrics
from tupe_jax.errors import UserError


def test_writer_jsonl_and_tensorboard(tmp_path):
    with metrics.MetricsWriter(str(tmp_path), enabled=True) as w:
        w.write(1, {"loss": jnp.float32(2.5), "learning_rate": np.float64(1e-4), "tokens": 10})
        w.write(2, {"loss": 2.0})
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl", encoding="utf-8")]
    assert rows == [{"step": 1, "loss": 2.5, "learning_rate": 1e-4, "tokens": 10}, {"step": 2, "loss": 2.0}]
    assert metrics.read_metrics(str(tmp_path))[1]["loss"] == 2.0
    events = os.listdir(tmp_path / "tensorboard")
    assert events and events[0].startswith("events.out.tfevents")


def test_an_event_row_is_in_the_jsonl_but_no_tensorboard_curve(tmp_path):
    """`init_from`'s row (which checkpoint step a continued run started from) drew an `init_step` curve."""
    with metrics.MetricsWriter(str(tmp_path), enabled=True) as w:
        w.write(0, {"event": "init_from", "init_from": "runs/x", "init_step": 7})
        w.write(1, {"loss_curve": 2.0})
    assert metrics.read_metrics(str(tmp_path))[0] == {"step": 0, "event": "init_from", "init_from": "runs/x",
                                                      "init_step": 7}
    (events,) = os.listdir(tmp_path / "tensorboard")
    written = (tmp_path / "tensorboard" / events).read_bytes()
    assert b"loss_curve" in written and b"init_step" not in written


def test_tensorboard_is_written_without_importing_torch_and_torch_still_imports_after(tmp_path):
    pytest.importorskip("torch")   # the test extras install it: the case where tensorboardX would import it
    code = ("import sys; from tupe_jax import metrics; w = metrics.MetricsWriter(sys.argv[1], enabled=True); "
            "w.write(1, {'loss_for_tb': 2.5}); w.close(); print('torch' in sys.modules); "
            "import torch; print(int(torch.ones(3).sum()))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()
    assert out == ["False", "3"]
    (events,) = os.listdir(tmp_path / "tensorboard")
    assert b"loss_for_tb" in (tmp_path / "tensorboard" / events).read_bytes()


def test_resume_marker_supersedes_the_redone_steps(tmp_path):
    with metrics.MetricsWriter(str(tmp_path), enabled=True, tensorboard=False) as w:
        for step in (1, 2, 3, 4, 5):
            w.write(step, {"loss": float(step)})
        w.write(3, {"event": metrics.RESUMED})          # restarted from the step-3 checkpoint
        for step in (4, 5, 6):
            w.write(step, {"loss": 10.0 + step})
    rows = metrics.read_metrics(str(tmp_path))
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]
    assert len(metrics.read_metrics(str(tmp_path), raw=True)) == 9


def test_a_torn_last_row_is_cut_when_a_writer_opens_and_a_bad_row_before_the_last_is_an_error(tmp_path, capsys):
    """A process killed mid-row left the file ending inside it; the next writer's first row continued that line,
    so both were unreadable and skipped in silence (a lost `resumed` row kept the stale rows of steps 5 and 6)."""
    with metrics.MetricsWriter(str(tmp_path), enabled=True, tensorboard=False) as w:
        for step in (1, 2, 3, 4, 5, 6):
            w.write(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 7, "lo')                      # killed while writing step 7's row
    assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1, 2, 3, 4, 5, 6]   # a live run's last row
    with metrics.MetricsWriter(str(tmp_path), enabled=True, tensorboard=False) as w:
        w.write(4, {"event": metrics.RESUMED})
        w.write(5, {"loss": 15.0})
    assert "its last row was cut short" in capsys.readouterr().out
    assert [(r["step"], r["loss"]) for r in metrics.read_metrics(str(tmp_path))] == [(1, 1.0), (2, 2.0), (3, 3.0),
                                                                                    (4, 4.0), (5, 15.0)]
    lines = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    merged = lines[:4] + ['{"step": 7, "lo' + lines[4]] + lines[5:]     # as writers before the cut left a file
    (tmp_path / "metrics.jsonl").write_text("\n".join(merged) + "\n")
    assert [(r["step"], r["loss"]) for r in metrics.read_metrics(str(tmp_path))] == [(1, 1.0), (2, 2.0), (3, 3.0),
                                                                                    (4, 4.0), (5, 15.0)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2] + ['{"step": 3, "lo'] + lines[3:]) + "\n")
    with pytest.raises(UserError, match=r"^error: .*metrics.jsonl line 3 is not a JSON row \('\{\"step\": 3, \"lo'\), "
                                        r"--workdir, "):
        metrics.read_metrics(str(tmp_path))


def test_writer_disabled_writes_nothing(tmp_path):
    w = metrics.MetricsWriter(str(tmp_path / "x"), enabled=False)
    w.write(1, {"loss": 1.0})
    w.close()
    assert not os.path.exists(tmp_path / "x")
    with pytest.raises(ValueError):
        metrics.MetricsWriter(str(tmp_path), enabled=True).write(1, {"v": np.ones(3)})


def test_progress_line():
    stream = io.StringIO()
    p = metrics.Progress(100, stream=stream)
    text = p.line(10, {"loss": 2.0})
    assert text.startswith("step 10/100 | loss 2 |") and "ETA" in text and stream.getvalue().strip() == text


def test_flops_and_mfu():
    # one layer, tiny numbers, counted by hand
    f = metrics.transformer_training_flops(1, 4, 8, 10, seq_len=3, batch_size=2, mlm_predictions=1)
    layer = 2 * (4 * 16 + 2 * 4 * 8) * 6
    attn = 4 * 9 * 4 * 2
    head = 2 * (16 + 40) * 2
    assert f == 3 * (layer + attn + head)
    # the last layer at the one predicted position: k, v on all 6 tokens, q, output and MLP on 2 rows, attention rows
    rows = metrics.transformer_training_flops(1, 4, 8, 10, seq_len=3, batch_size=2, mlm_predictions=1,
                                              last_layer_predictions=True)
    assert rows == 3 * (2 * (2 * 16) * 6 + 2 * (2 * 16 + 2 * 4 * 8) * 2 + 4 * 1 * 3 * 4 * 2 + head)
    causal = metrics.transformer_training_flops(1, 4, 8, 10, seq_len=3, batch_size=2, causal=True)
    assert causal == 3 * (layer + attn / 2 + 2 * 4 * 10 * 6)
    # BERT-base, batch 256 x 512, P=20 gathered: ~6 N tokens with N = 85M + attention
    base = metrics.transformer_training_flops(12, 768, 3072, 30522, 512, 256, mlm_predictions=20)
    assert 6.6e13 < base < 8e13
    assert metrics.mfu(1e12, 1.0, 2, 1.0) == pytest.approx(0.5)
    assert np.isnan(metrics.mfu(1e12, 1.0, 2, 0.0))
    assert metrics.peak_tflops(0.0, "TPU v4") == 275.0 and metrics.peak_tflops(123.0) == 123.0
    assert metrics.peak_tflops(0.0, "cpu") == 0.0
    # the PCIe H100's dense bf16 peak, not the SXM part's (its device kind also contains "h100")
    assert metrics.peak_tflops(0.0, "NVIDIA H100 PCIe") == 756.0
    assert metrics.peak_tflops(0.0, "NVIDIA H100 80GB HBM3") == 989.0
