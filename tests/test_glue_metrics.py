"""GLUE metrics agree with scikit-learn / scipy; headline keys and the paper's average; submission files; the
sweep's median-of-best-lr table (from fabricated results.json files)."""
import json
import os

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from tupe_jax.finetune import scores

LABELS = np.array([1, 0, 1, 1, 0, 1, 0, 0, 1, 1])
PREDS = np.array([1, 0, 0, 1, 0, 1, 1, 0, 1, 0])


def _logits(preds, classes=2):
    out = np.full((len(preds), classes), -1.0)
    out[np.arange(len(preds)), preds] = 1.0
    return out


def test_classification_metrics_match_sklearn_and_known_values():
    assert scores.accuracy(LABELS, PREDS) == pytest.approx(0.7)
    # tp=4, fp=1, fn=2 -> precision 0.8, recall 2/3, F1 = 8/11; MCC = (tp*tn - fp*fn)/sqrt(...) = 10/sqrt(600)
    assert scores.f1(LABELS, PREDS) == pytest.approx(8 / 11)
    assert scores.matthews(LABELS, PREDS) == pytest.approx(10 / np.sqrt(600))
    assert scores.f1(LABELS, PREDS) == pytest.approx(skm.f1_score(LABELS, PREDS))
    assert scores.matthews(LABELS, PREDS) == pytest.approx(skm.matthews_corrcoef(LABELS, PREDS))
    cola = scores.task_metrics("cola", LABELS, _logits(PREDS))
    assert cola["matthews_corr"] == pytest.approx(skm.matthews_corrcoef(LABELS, PREDS))
    assert set(scores.task_metrics("mrpc", LABELS, _logits(PREDS))) == {"accuracy", "f1"}
    assert set(scores.task_metrics("qqp", LABELS, _logits(PREDS))) == {"accuracy", "f1"}
    three = np.array([0, 1, 2, 2, 1, 0])
    assert scores.task_metrics("mnli", three, _logits(np.array([0, 1, 2, 0, 1, 1]), 3)) == {"accuracy": pytest.approx(4 / 6)}
    assert scores.majority_accuracy(LABELS) == pytest.approx(0.6)


def test_regression_metrics_match_scipy():
    gold = np.array([0.0, 1.0, 2.5, 3.0, 4.2, 5.0])
    pred = np.array([0.3, 0.8, 2.0, 3.9, 3.8, 4.1])
    out = scores.task_metrics("stsb", gold, pred[:, None])
    assert out["pearson"] == pytest.approx(stats.pearsonr(gold, pred)[0])
    assert out["spearman"] == pytest.approx(stats.spearmanr(gold, pred)[0])
    assert scores.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert scores.spearman([1, 2, 3], [1, 4, 9]) == pytest.approx(1.0)
    assert scores.pearson([1, 2, 3], [1, 1, 1]) == 0.0  # a collapsed regressor is 0, not NaN


def test_headline_keys_and_paper_average():
    assert [scores.headline_key(t) for t in ("cola", "stsb", "mrpc", "qqp", "mnli", "rte")] == [
        "matthews_corr", "pearson", "accuracy", "accuracy", "accuracy", "accuracy"]
    # TUPE-R row of Table 1 averages to the paper's 85.04
    tupe_r = {"MNLI-m": 86.21, "MNLI-mm": 86.19, "QNLI": 92.17, "QQP": 91.30, "SST-2": 93.26, "CoLA": 63.56,
              "MRPC": 89.89, "RTE": 73.56, "STS-B": 89.23, "WNLI": 10.0}
    avg, used = scores.glue_average(tupe_r)
    assert round(avg, 2) == 85.04 and len(used) == 9 and "WNLI" not in used
    assert scores.glue_average({}) == (None, [])


@pytest.mark.parametrize("task,outputs,expected", [
    ("rte", _logits(np.array([0, 1])), ["entailment", "not_entailment"]),
    ("qnli", _logits(np.array([1])), ["not_entailment"]),
    ("mnli", _logits(np.array([0, 1, 2]), 3), ["entailment", "neutral", "contradiction"]),
    ("mnli_mm", _logits(np.array([2]), 3), ["contradiction"]),
    ("ax", _logits(np.array([1]), 3), ["neutral"]),
    ("cola", _logits(np.array([1, 0])), ["1", "0"]),
    ("sst2", _logits(np.array([0])), ["0"]),
    ("stsb", np.array([[3.14159], [7.0], [-1.0]]), ["3.142", "5.000", "0.000"]),
])
def test_submission_files(tmp_path, task, outputs, expected):
    idx = list(range(100, 100 + len(outputs)))
    path = scores.write_submission(str(tmp_path), task, idx, outputs)
    assert os.path.basename(path) == scores.SUBMISSION_FILES[task] + ".tsv"
    lines = open(path, encoding="utf-8").read().splitlines()
    assert lines[0] == "index\tprediction"
    assert lines[1:] == [f"{i}\t{p}" for i, p in zip(idx, expected)]


def test_official_file_names():
    assert {scores.SUBMISSION_FILES[t] for t in ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "mnli_mm", "qnli", "rte",
                                             "wnli", "ax")} == {
        "CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI-m", "MNLI-mm", "QNLI", "RTE", "WNLI", "AX"}


def test_sweep_summary_median_of_best_lr(tmp_path):
    def run_dir(root, task, lr, seed):
        return os.path.join(root, task, f"lr={lr:g}", f"seed={seed}")

    results = {("rte", 2e-5): [0.60, 0.70, 0.65], ("rte", 3e-5): [0.72, 0.50, 0.71],
               ("mnli", 2e-5): [0.80, 0.81, 0.79], ("mnli", 3e-5): [0.82, 0.83, 0.10]}
    for (task, lr), values in results.items():
        for seed, v in enumerate(values):
            d = run_dir(str(tmp_path), task, lr, seed)
            os.makedirs(d)
            metrics = {"accuracy": v} if task == "rte" else {"accuracy": v, "accuracy_mm": v - 0.01}
            with open(os.path.join(d, "results.json"), "w") as f:
                json.dump({"best": {"metrics": metrics}}, f)
    os.remove(os.path.join(run_dir(str(tmp_path), "rte", 3e-5, 2), "results.json"))  # unfinished run: ignored
    s = scores.summarize_sweep(str(tmp_path), ["rte", "mnli"], [2e-5, 3e-5], [0, 1, 2], run_dir)
    rte = s["tasks"]["rte"]
    assert rte["lrs"]["2e-05"]["median"]["RTE"] == pytest.approx(65.0)
    assert rte["lrs"]["3e-05"]["median"]["RTE"] == pytest.approx(61.0) and rte["lrs"]["3e-05"]["runs"] == 2
    assert rte["best_lr"] == "2e-05" and s["reported"]["RTE"] == pytest.approx(65.0)
    assert s["tasks"]["mnli"]["best_lr"] == "3e-05"
    assert s["reported"]["MNLI-m"] == pytest.approx(82.0) and s["reported"]["MNLI-mm"] == pytest.approx(81.0)
    assert s["glue_average"] == pytest.approx((65.0 + 82.0 + 81.0) / 3)
    md = scores.sweep_markdown(s)
    assert "| MNLI-m | MNLI-mm | RTE | Avg |" in md and "**best**" in md
