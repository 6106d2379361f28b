"""Test fixtures for GLUE fine-tuning: a GLUE directory in the real layouts (all nine tasks) and a tiny
pretraining checkpoint (a TransformerLM saved the way `launch pretrain` saves it)."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(num_layers=2, hidden_size=32, num_heads=2, mlp_dim=64, vocab_size=512, max_len=64)

WORDS_A = ("cat dog bird fish horse mouse lion tiger bear wolf fox deer goat sheep cow duck frog owl crab seal "
           "apple bread cheese honey lemon melon olive onion pepper plum").split()
WORDS_B = ("table chair window door floor roof wall stair bench shelf lamp clock mirror carpet pillow blanket "
           "river mountain valley forest desert island ocean meadow canyon glacier").split()


def load_config_module(name):
    spec = importlib.util.spec_from_file_location(f"test_cfg_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pair(rng, label):
    """Premise of 6-9 WORDS_A words; hypothesis = 3 of them (entailment, 0) or 3 WORDS_B words (1)."""
    a = list(rng.choice(WORDS_A, rng.integers(6, 10), replace=False))
    b = list(rng.choice(a, 3, replace=False)) if label == 0 else list(rng.choice(WORDS_B, 3, replace=False))
    return " ".join(a) + " .", " ".join(b) + " ."


def _rows(task, split, n, rng):
    """TSV text of one split of `task` with `n` rows, in the download_glue_data.py layout."""
    test = split.startswith("test")
    out = []
    for i in range(n):
        label = int(rng.integers(0, 2))
        s1, s2 = _pair(rng, label)
        if task == "cola":
            out.append(f"{i}\t{s1}" if test else f"gj04\t{label}\t{'' if label else '*'}\t{s1}")
        elif task == "sst2":
            out.append(f"{i}\t{s1}" if test else f"{s1}\t{label}")
        elif task == "mrpc":
            out.append(f"{i}\t{i}\t{i + 1}\t{s1}\t{s2}" if test else f"{1 - label}\t{i}\t{i + 1}\t{s1}\t{s2}")
        elif task == "stsb":
            head = f"{i}\tmain\tf\t2012\t{i:04d}\tnone\tnone\t{s1}\t{s2}"
            out.append(head if test else f"{head}\t{5.0 * (1 - label):.3f}")
        elif task == "qqp":
            out.append(f"{i}\t{s1}\t{s2}" if test else f"{i}\t{2 * i}\t{2 * i + 1}\t{s1}\t{s2}\t{1 - label}")
        elif task == "mnli":
            three = ("entailment", "neutral", "contradiction")[label * 2]
            head = f"{i}\t1\t{i}e\tgov\tb\tb\tp\tp\t{s1}\t{s2}"
            if test:
                out.append(head)
            elif split == "train":
                out.append(f"{head}\t{three}\t{three}")
            else:
                out.append(f"{head}\t{three}\tx\tx\tx\tx\t{three}")
        elif task in ("qnli", "rte"):
            out.append(f"{i}\t{s1}\t{s2}" if test else f"{i}\t{s1}\t{s2}\t{('entailment', 'not_entailment')[label]}")
        elif task == "wnli":
            out.append(f"{i}\t{s1}\t{s2}" if test else f"{i}\t{s1}\t{s2}\t{1 - label}")
    return out


HEADERS = {
    "cola": (None, "index\tsentence"),
    "sst2": ("sentence\tlabel", "index\tsentence"),
    "mrpc": ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String", "index\t#1 ID\t#2 ID\t#1 String\t#2 String"),
    "stsb": ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
             "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"),
    "qqp": ("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "id\tquestion1\tquestion2"),
    "qnli": ("index\tquestion\tsentence\tlabel", "index\tquestion\tsentence"),
    "rte": ("index\tsentence1\tsentence2\tlabel", "index\tsentence1\tsentence2"),
    "wnli": ("index\tsentence1\tsentence2\tlabel", "index\tsentence1\tsentence2"),
}
MNLI_HEAD = "index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2"
DIRS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP", "mnli": "MNLI",
        "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}


def write_glue_dir(root, sizes=None, seed=0):
    """All nine tasks; `sizes` = {task: (train, dev, test)} (default (16, 8, 5)). Returns {task: sizes}."""
    rng = np.random.default_rng(seed)
    sizes = {t: (sizes or {}).get(t, (16, 8, 5)) for t in DIRS}
    for task, (n_train, n_dev, n_test) in sizes.items():
        d = os.path.join(root, DIRS[task])
        os.makedirs(d, exist_ok=True)
        if task == "mnli":
            files = {"train": (MNLI_HEAD + "\tlabel1\tgold_label", n_train),
                     "dev_matched": (MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label", n_dev),
                     "dev_mismatched": (MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label", n_dev),
                     "test_matched": (MNLI_HEAD, n_test), "test_mismatched": (MNLI_HEAD, n_test + 1)}
        else:
            head, test_head = HEADERS[task]
            files = {"train": (head, n_train), "dev": (head, n_dev), "test": (test_head, n_test)}
        for stem, (head, n) in files.items():
            lines = ([head] if head else []) + _rows(task, stem, n, rng)
            with open(os.path.join(d, f"{stem}.tsv"), "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    os.makedirs(os.path.join(root, "diagnostic"), exist_ok=True)
    with open(os.path.join(root, "diagnostic", "diagnostic.tsv"), "w", encoding="utf-8") as f:
        pairs = [_pair(rng, i % 2) for i in range(7)]
        f.write("index\tsentence1\tsentence2\n" + "".join(f"{i}\t{a}\t{b}\n" for i, (a, b) in enumerate(pairs)))
    return sizes


def tiny_model_overrides(config, **extra):
    config.model.update(dict(TINY, **extra))
    return config


def make_pretrained(workdir, cache_dir, pe="tupe_r", steps=(10,), **model):
    """Init a tiny TransformerLM and save it as a pretraining run: config.json, tokenizer/, checkpoints/<step> for
    each of `steps` (the same params in each)."""
    from tupe_jax import checkpoint as ckpt
    from tupe_jax import data as data_lib
    from tupe_jax import workdir as workdir_lib
    from tupe_jax.model import ModelConfig, init_params

    config = load_config_module("pretrain").get_config(f"pe={pe},size=tiny")
    tiny_model_overrides(config, **model)
    config.data.cache_dir = str(cache_dir)
    os.makedirs(workdir, exist_ok=True)
    workdir_lib.write_config(str(workdir), config)
    data_lib.get_tokenizer(config, str(workdir))
    params = init_params(ModelConfig.from_config(config.model), jax.random.PRNGKey(1))
    with ckpt.Checkpointer(str(workdir), async_=False) as c:
        for step in steps:
            state = {"step": jnp.int32(step), "params": params, "opt_state": optax.adamw(1e-3).init(params),
                     "rng": jax.random.PRNGKey(0)}
            c.save(step, state, data_state={}, meta=workdir_lib.make_meta(config, params), force=True)
    return params


def glue_env(root) -> dict:
    """In `root`: a cache dir, a tiny tupe_r pretraining run, and a GLUE dir with all nine tasks (RTE learnable,
    bigger)."""
    os.environ["TUPE_JAX_CACHE"] = str(root / "cache")
    pre = root / "pre"
    params = make_pretrained(pre, root / "cache")
    sizes = write_glue_dir(str(root / "glue"), {"rte": (256, 64, 40)})
    return {"root": root, "pre": str(pre), "params": params, "glue": str(root / "glue"), "sizes": sizes}


def make_config(env, task="rte", pe="tupe_r", init=True, **train):
    """A tiny fine-tune config on `glue_env`'s GLUE dir, from its pretraining run (`init`)."""
    config = load_config_module("glue").get_config(f"task={task},pe={pe},size=tiny")
    tiny_model_overrides(config)
    config.data.cache_dir = str(env["root"] / "cache")
    config.data.glue_dir = env["glue"]
    config.data.glue_buckets = (32, 64)
    config.init_from = env["pre"] if init else ""
    config.train.update(dict(dict(batch_size=16, eval_batch_size=16, log_every=8, learning_rate=1e-3), **train))
    config.checkpoint.async_save = False
    return config

