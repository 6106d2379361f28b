"""Experiment configs, big_vision style: each module has `get_config(arg)` returning a locked ConfigDict.

Pick one on the command line with `--config=configs/pretrain.py:pe=tupe_r,size=tiny` and override single keys
with `--config.train.steps=200`. Loading, overrides and validation live in `tupe_jax.config`.
"""
