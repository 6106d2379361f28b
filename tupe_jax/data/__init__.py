"""Data layer: TFDS builders (array_record, no TensorFlow), WordPiece tokenizer, MLM/CLM/GLUE batches, grain.

Modules: `batch` (the typed batches), `tokenizer`, `sources` (text files, WikiText, the embedded corpus),
`builders` (TFDS builders and caches), `stamps` (what a source file is known by in their keys), `pipeline` (pretraining batches, resumable), `masking`, `classification`
(GLUE/word-order batches), `glue_tsv` (the GLUE TSV layouts), `prepare` (`launch prepare`: a corpus tokenized
once, in parallel, into sharded ArrayRecord + manifest), `prepared` (reading such a directory per process).

Public API:
  default_data_config()                                   -> ml_collections.ConfigDict (the `config.data` keys)
  get_tokenizer(config, workdir)                          -> Tokenizer
  token_stream(config, tokenizer, split)                  -> the split's flat token stream (the analyses')
  pretrain_iterator(config, tokenizer, *, split, global_batch_size, seed, process_index=None,
                    process_count=None, shuffle=True, repeat=True)  -> PretrainIterator (get_state/set_state)
  load_documents(config, split)                           -> list[str]
  glue_examples(config, task, split)                      -> list[dict]
  glue_batches(config, tokenizer, task, split, *, batch_size, ...) -> GlueBatches (iterable, len())
  num_labels(task)                                        -> int
  GLUE_TASKS                                              -> the task names (nine GLUE + 'wordorder')
  validate_config(config)                                 -> checks the pretraining data keys (UserError)
  check_data_keys(config) / corpus_keys(name, objective)  -> the values of the keys / which keys a corpus reads

The pipelines read `config.data` (below) and `config.model.{vocab_size, max_len, objective}`.
"""
from __future__ import annotations

import ml_collections

from tupe_jax.config import require_one_of
from tupe_jax.errors import require

from tupe_jax.data.builders import glue_examples, load_documents
from tupe_jax.data.batch import ClassificationBatch, LMBatch
from tupe_jax.data.classification import glue_batches
from tupe_jax.data.glue_tsv import num_labels
from tupe_jax.data.pipeline import PretrainIterator, pretrain_iterator
from tupe_jax.data import pipeline, prepared
from tupe_jax.data.sources import check_source, check_train_files, refuse_inside_corpus
from tupe_jax.data.tokenizer import Tokenizer, check_learned_vocab_size
from tupe_jax.data.tokenizer import get_tokenizer as _corpus_tokenizer

GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli", "wordorder")


def get_tokenizer(config: ml_collections.ConfigDict, workdir) -> Tokenizer:
    """The run's tokenizer: a prepared directory's (`data.name=prepared`), else `tokenizer.get_tokenizer`."""
    if config.data.get("name", "") == "prepared":
        return prepared.prepared_tokenizer(config, workdir)
    return _corpus_tokenizer(config, workdir)


def token_stream(config: ml_collections.ConfigDict, tokenizer: Tokenizer, split: str):
    """The flat token stream of a split of the run's corpus ([SEP] after every document; int32, memory-mapped):
    a prepared directory's, read back from its records, or the corpus tokenized in the cache."""
    if config.data.get("name", "") == "prepared":
        return prepared.token_stream(config, split)
    return pipeline.token_stream(config, tokenizer, split)[0]


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Check the pretraining data keys against the model (`config.data`, `config.model`) before any compute."""
    check_data_keys(config)
    check_train_files(config.data)
    if config.data.get("name", "") != "prepared" and not config.data.get("vocab_file", ""):
        check_learned_vocab_size(config.model.vocab_size)
    if config.data.get("name", "") == "prepared":
        prepared.open_split(config, "train")   # settings, every shard present and as the manifest says


def check_data_keys(config: ml_collections.ConfigDict) -> None:
    """The values of the `config.data` keys that choose and mask the text (also another corpus for an analysis)."""
    check_source(config.data)
    require_one_of(config.data.get("split_by", "blank_line"), ("blank_line", "file"), "data.split_by")
    for key in ("prefetch", "num_threads"):
        require(int(config.data.get(key, 0)) >= 0, f"data.{key} = {config.data.get(key)} is negative",
                f"--config.data.{key}", "give 0 (none / in the main thread) or more")
    data = config.data
    require(0.0 < data.mask_prob < 1.0, f"data.mask_prob = {data.mask_prob} is outside (0, 1)", "--config.data.mask_prob",
            "use e.g. 0.15")      # MLM keys are checked in a causal run too: a bad value is a mistake either way
    require(0 <= data.max_predictions <= config.model.max_len,
            f"data.max_predictions = {data.max_predictions} is outside [0, model.max_len]",
            "--config.data.max_predictions", "use 0 (= ceil(mask_prob * max_len)) or e.g. 20 for max_len 128")
    if config.model.objective != "mlm":
        return
    # masking picks round(mask_prob * n) of the n <= max_len - 1 text tokens of a sequence ([CLS] is never masked)
    require(data.mask_prob * (config.model.max_len - 1) >= 0.5,
            f"data.mask_prob = {data.mask_prob} with model.max_len = {config.model.max_len} masks no position "
            f"(round({data.mask_prob} x {config.model.max_len - 1} text tokens) = 0): the loss would be 0",
            "--config.data.mask_prob", "raise data.mask_prob or model.max_len")


def corpus_keys(name: str, objective: str) -> tuple[str, ...]:
    """The `config.data` keys a corpus `data.name` and a model `objective` read (the others do nothing there)."""
    keys = {"embedded": (), "text_files": ("path", "file_pattern", "split_by", "holdout"),
            "wikitext": ("path", "file_pattern", "holdout"), "prepared": ("path",)}.get(
                name, ("tfds_data_dir", "tfds_text_key") if name.startswith("tfds:") else ())
    mlm = ("mask_prob", "max_predictions", "packing")     # a prepared directory's packing is checked against it
    return ("name", "cache_dir", "prefetch", "num_threads") + keys + (mlm if objective == "mlm" else ())


def default_data_config() -> ml_collections.ConfigDict:
    """All `config.data` keys with their defaults.

    name            'embedded' | 'text_files' | 'wikitext' | 'tfds:<name>[/<config>][:<version>]' | 'prepared'
                    (data.path = a directory written by `launch prepare`; docs/data.md). 'embedded' is
                    the CPython documentation text (`pydoc_data.topics`), built on first use; paragraphs
                    i%20==19 → validation, i%20==9 → test.
    path            text_files / wikitext: a directory, a glob, or a file. Files named *train*/*valid*|*dev*/
                    *test* (name cut at . _ -) form those splits; otherwise all files are training text.
    file_pattern    glob inside a `path` directory (refused with a file or glob path); '' = files ending .txt .tokens
                    .raw .text.
    split_by        text_files: 'blank_line' (BERT format: one sentence per line, blank line between documents)
                    or 'file' (one document per file). wikitext always splits at ` = Title = ` lines.
    holdout         with no validation file: document i → validation when i % holdout == holdout-1 (TUPE's
                    1-in-200); 0 = no validation split.
    packing         MLM: 'full_sentences' (RoBERTa FULL-SENTENCES: whole lines packed up to max_len-1 tokens,
                    [SEP] between documents) or 'contiguous' (cut every max_len-1 tokens). CLM is contiguous.
    vocab_file      '' = train a WordPiece vocab of config.model.vocab_size on the train split; else a vocab.txt
                    holding [PAD] [UNK] [CLS] [SEP] [MASK] (anywhere: BERT's layout works; casing from a
                    tokenizer_config.json next to it). Pretraining batches take the special ids from it.
    mask_prob       MLM: fraction of candidate tokens masked (80% [MASK], 10% random, 10% kept).
    max_predictions MLM: P, the width of mlm_positions/labels/weights; 0 = ceil(mask_prob · max_len) (20 for 128).
                    A sequence never gets more than P masked positions.
    glue_dir        directory in the download_glue_data.py layout; '' = tfds 'glue/<task>' from TFDS_DATA_DIR.
    glue_buckets    padded lengths of GLUE batches (capped at max_len; max_len is always allowed).
    cache_dir       prepared datasets and token streams; '' = $TUPE_JAX_CACHE or ~/.cache/tupe_jax.
    tfds_data_dir   data_dir for tfds:<name> ('' = $TFDS_DATA_DIR or ~/tensorflow_datasets).
    tfds_text_key   feature holding the text for tfds:<name> ('' = 'text' or the first Text feature).
    prefetch        batches prefetched per process (0 = none, synchronous).
    num_threads     threads building batches when prefetch > 0 (`launch prepare`: worker processes, 0 = all cores).
    """
    c = ml_collections.ConfigDict()
    c.name = "embedded"
    c.path = ""
    c.file_pattern = ""
    c.split_by = "blank_line"
    c.holdout = 200
    c.packing = "full_sentences"
    c.vocab_file = ""
    c.mask_prob = 0.15
    c.max_predictions = 0
    c.glue_dir = ""
    c.glue_buckets = (32, 64, 128, 256, 512)
    c.cache_dir = ""
    c.tfds_data_dir = ""
    c.tfds_text_key = ""
    c.prefetch = 4
    c.num_threads = 2
    return c


__all__ = ["default_data_config", "validate_config", "check_data_keys", "corpus_keys", "LMBatch",
           "ClassificationBatch", "get_tokenizer", "Tokenizer", "pretrain_iterator", "PretrainIterator",
           "load_documents", "glue_examples", "glue_batches", "num_labels", "GLUE_TASKS", "token_stream",
           "refuse_inside_corpus"]
