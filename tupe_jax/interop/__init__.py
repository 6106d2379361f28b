"""Hugging Face interop: `import-hf` (a BERT folder -> a `bert_a` run) and `export` (a run -> `BertForMaskedLM`
layout for bert_a MLMs, this project's native safetensors layout for every other scheme). Safetensors only.

    names.py            the name map (BERT <-> ours, and the native map); docs/interop.md prints it
    safetensors_io.py   reading (single or sharded, PyTorch or Flax names) and writing safetensors
    hf.py               `import_hf(src, workdir, base_config)`, `convert` (nothing written), the config mapping
    export.py           `export(workdir, out, step=None)`
    fairseq.py          `import_fairseq(src, workdir, base_config)`: the TUPE authors' fairseq checkpoint -> a
                        tupe_r/tupe_a run (torch.load weights_only + an allowlist; the `fairseq` extra)
    fairseq_names.py    the name map (the TUPE code's BertModel <-> ours)

`transformers` is never imported here (it is a test-only dependency, the `hf` extra).
"""
