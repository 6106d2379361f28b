"""Transformer language models with a pluggable positional scheme.

- `objective='mlm'`: bidirectional encoder, post-LN blocks (as TUPE's code), [CLS] at index 0, MLM head
  dense+GELU+LayerNorm+output tied to the token embedding (+bias);
- `objective='clm'`: causal decoder, pre-LN blocks with a final LayerNorm, LM head tied to the embedding.

The scheme (`positional/`) is called once per forward; its terms are threaded through every block. With
`last_layer_rows="predicted"` an MLM encoder's last block computes its outputs at the head's positions only.
Params are float32 with logical axis names (vocab, embed, mlp, heads, kv, qkv, pos, buckets) for `sharding.py`;
compute runs in `dtype`. `SequenceClassifier` (GLUE) reuses the same `Transformer` under the same name, `encoder`,
so a pretraining checkpoint's `params['encoder']` drops straight in.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from tupe_jax import attention as attention_lib
from tupe_jax import positional
from tupe_jax.activations import gelu
from tupe_jax.attention import ATTENTION_BACKENDS, SelfAttention, attention_mask
from tupe_jax.dropout import DROPOUT_BITS, MAX_HASHES16, Rows, hashes16, make_dropout, take_rows
from tupe_jax.errors import require
from tupe_jax.head import tied_cross_entropy, tied_logits
from tupe_jax.positional import PositionalSettings, canonical_name, make_positional
from tupe_jax.projection import dense_dot_general
from tupe_jax.sharding import constrain

# The one dtype table: validation and compute both read it. float16 is absent on purpose: training in it needs
# loss scaling, which this project does not implement; bfloat16 has float32's range and needs none.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
OBJECTIVES = ("mlm", "clm")
# `model.last_layer_rows`: where an MLM encoder's last block computes past its keys and values when the head reads
# the masked positions only (`TransformerLM`'s mlm_positions): "all" positions, or the "predicted" ones (P < L:
# the rows of the same outputs, dropout masks included, with the loss and gradients equal up to float rounding)
LAST_LAYER_ROWS = ("all", "predicted")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    mlp_dim: int = 512
    max_len: int = 128
    dtype: str = "float32"
    pe: str = "tupe_r"
    objective: str = "mlm"
    untie_cls: bool = True
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    rope_base: float = 10000.0
    rope_style: str = "half"
    rope_fraction: float = 1.0
    rel_num_buckets: int = 32
    rel_max_distance: int = 128
    layer_norm_eps: float = 1e-5
    attention_backend: str = "einsum"   # einsum | xla | cudnn | pallas (see attention.py)
    tupe_form: str = "bias"             # TUPE position term as a logit bias or as concatenated heads (tupe.py)
    sinusoidal_style: str = "scaled"    # scaled | fairseq (positional/sinusoidal.py)
    dropout_bits: int = 32              # 32 (nn.Dropout; configs/pretrain.py sets 16) | 16 (dropout.py)
    type_vocab_size: int = 0            # segment embeddings (BERT's token types): 0 none, else rows (Transformer)
    last_layer_rows: str = "all"        # all | predicted (LAST_LAYER_ROWS; configs/pretrain.py sets predicted)

    @classmethod
    def from_config(cls, model_config: Any) -> "ModelConfig":
        """Build from an ml_collections `config.model` (keys outside this dataclass are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in dict(model_config).items() if k in names}
        return cls(**values)

    @property
    def causal(self) -> bool:
        return self.objective == "clm"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    def positional_settings(self) -> PositionalSettings:
        return PositionalSettings(
            hidden_size=self.hidden_size, num_heads=self.num_heads, max_len=self.max_len, causal=self.causal,
            untie_cls=self.untie_cls and not self.causal, rope_base=self.rope_base, rope_style=self.rope_style,
            rope_fraction=self.rope_fraction, rel_num_buckets=self.rel_num_buckets,
            rel_max_distance=self.rel_max_distance, layer_norm_eps=self.layer_norm_eps, tupe_form=self.tupe_form,
            sinusoidal_style=self.sinusoidal_style, dtype=self.compute_dtype)


def validate_config(model: Any) -> None:
    """Check a `config.model` section (shape, dtype, objective, backend, positional keys) before any compute."""
    for key in ("num_layers", "hidden_size", "num_heads", "mlp_dim", "vocab_size", "max_len", "rope_base",
                "layer_norm_eps"):
        require(model[key] > 0, f"model.{key} = {model[key]} must be positive", f"--config.model.{key}",
                "give a positive value")
    require(model.dtype != "float16", "model.dtype float16 is not supported (it needs loss scaling, which is not "
            "implemented)", "--config.model.dtype", "use bfloat16 (same speed, float32's range) or float32")
    require(model.get("type_vocab_size", 0) >= 0, f"model.type_vocab_size = {model.get('type_vocab_size')} is "
            "negative", "--config.model.type_vocab_size", "give 0 (no segment embeddings) or the number of segments")
    for key, known in (("dtype", tuple(DTYPES)), ("objective", OBJECTIVES), ("attention_backend", ATTENTION_BACKENDS),
                       ("dropout_bits", DROPOUT_BITS), ("last_layer_rows", LAST_LAYER_ROWS)):
        value = model.get(key, known[0])   # known[0]: ModelConfig's default (a key a stored config may lack)
        require(value in known, f"unknown model.{key} {value!r}", f"--config.model.{key}",
                "use one of " + "|".join(map(str, known)))
    require(model.hidden_size % model.num_heads == 0,
            f"model.hidden_size = {model.hidden_size} is not divisible by model.num_heads = {model.num_heads}",
            "--config.model.num_heads", "pick a head count that divides hidden_size")
    for key in ("dropout_rate", "attention_dropout_rate"):
        require(0.0 <= model[key] < 1.0, f"model.{key} = {model[key]} is outside [0, 1)", f"--config.model.{key}",
                "give a rate in [0, 1)")
    positional.validate_config(model)
    require(not (model.objective == "clm" and model.untie_cls),
            "model.untie_cls must be False for objective=clm (no [CLS] to untie)", "--config.model.untie_cls",
            "set it to false")


def validate_training(config: Any, platform: str, lengths: Sequence[int]) -> None:
    """Check what only training meets, before any compute (`platform`: `jax.default_backend()`): the cudnn backend
    needs a GPU; on a GPU the pallas kernel would train with attention dropout hashed in the kernel
    (`attention.PALLAS_DROPOUT_MASK = "in_kernel"`, 16-bit masks, threefry keys, one of the sequence `lengths` the
    loop trains at that it tiles) through a backward whose compile does not finish there
    (`attention.PALLAS_IN_KERNEL_DROPOUT_COMPILES_ON_GPU`). Readers of a run (`workdir.run.load_run`) read a cudnn
    run off a GPU with xla instead, and say so."""
    m = config.model
    if m.dropout_bits == 16:       # the largest masks' hashes, over the global batch (dropout.check_hashes16)
        batch, length = int(config.train.batch_size), max(lengths)
        masks = [(batch, m.num_heads, length, length)] * (m.attention_dropout_rate > 0) + \
            [(batch, length, m.hidden_size)] * (m.dropout_rate > 0)
        worst = max(masks, key=hashes16, default=None)
        require(worst is None or hashes16(worst) <= MAX_HASHES16, f"a 16-bit dropout mask of shape {worst} (train."
                f"batch_size {batch}) needs {hashes16(worst) if worst else 0} hashes, past the {MAX_HASHES16} its "
                "32-bit counters number apart: masks would repeat", "--config.model.dropout_bits",
                "set it to 32 (flax's masks, 64-bit counters), or train a smaller global batch or length")
    require(not (m.attention_backend == "cudnn" and platform != "gpu"),
            f"model.attention_backend=cudnn needs a GPU, and this machine's JAX backend is {platform}",
            "--config.model.attention_backend", "use xla (the same maths, any machine) or einsum here")
    stalls = (platform == "gpu" and m.attention_backend == "pallas" and m.attention_dropout_rate > 0
              and m.dropout_bits == 16 and config.train.get("dropout_rng", "threefry2x32") == "threefry2x32"
              and attention_lib.PALLAS_DROPOUT_MASK != "precomputed"
              and any(attention_lib.pallas_kernel_fits(n) for n in lengths)
              and not attention_lib.PALLAS_IN_KERNEL_DROPOUT_COMPILES_ON_GPU)
    require(not stalls, "model.attention_backend=pallas with attention dropout hashed in the kernel does not train "
            "on a GPU yet: its backward stalled XLA's compile on an H200 (benchmarks/RESULTS.md, GPU round 2)",
            "attention.PALLAS_DROPOUT_MASK", "set it to \"precomputed\" (the default; the same masks) or use "
            "attention_backend=einsum")


def layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.compute_dtype, name=name,
                        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


def dense(features: int, axes: tuple[str, str], cfg: ModelConfig, name: str) -> nn.Dense:
    return nn.Dense(features, dtype=cfg.compute_dtype, name=name, dot_general=dense_dot_general,
                    kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), axes),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes[1],)))


class Block(nn.Module):
    """Attention + GELU MLP; post-LN (encoder) or pre-LN (decoder)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, terms, mask, deterministic: bool, return_probs: bool = False, causal_only: bool = False,
                 rows=None):
        """`rows` (B, P) (encoder): the block's output at those positions only, (B, P, d) (attention's `rows`)."""
        cfg = self.cfg
        if cfg.causal and rows is not None:
            raise ValueError("Block: rows are an MLM encoder's (a causal decoder predicts every position)")
        drop = make_dropout(cfg.dropout_rate, cfg.dropout_bits)
        attn = SelfAttention(cfg.num_heads, cfg.head_dim, cfg.compute_dtype, cfg.attention_dropout_rate,
                             cfg.attention_backend, cfg.dropout_bits, name="attention")
        mlp_in = dense(cfg.mlp_dim, ("embed", "mlp"), cfg, "mlp_in")
        mlp_out = dense(cfg.hidden_size, ("mlp", "embed"), cfg, "mlp_out")

        def mlp(h):
            return mlp_out(gelu(constrain(mlp_in(h), ("batch", "length", "mlp"))))

        if cfg.causal:  # pre-LN
            a, probs = attn(layer_norm(cfg, "ln_attention")(x), terms, mask, deterministic, return_probs, causal_only)
            x = x + drop(a, deterministic=deterministic)
            x = x + drop(mlp(layer_norm(cfg, "ln_mlp")(x)), deterministic=deterministic)
        else:  # post-LN
            a, probs = attn(x, terms, mask, deterministic, return_probs, rows=rows)
            at = None if rows is None else Rows(rows[:, :, None], 1, x.shape[1])
            x = x if at is None else take_rows(x, at)
            x = layer_norm(cfg, "ln_attention")(x + drop(a, deterministic=deterministic, rows=at))
            x = layer_norm(cfg, "ln_mlp")(x + drop(mlp(x), deterministic=deterministic, rows=at))
        return constrain(x, ("batch", "length", "embed")), probs


class Transformer(nn.Module):
    """Token embedding + positional scheme + blocks. Returns the final hidden states and optional extras.

    With `cfg.type_vocab_size` > 1 a segment embedding (BERT's token types) is added to the input: row
    `segments[b, i]` (B, L) int32, 0 where `segments` is None (as transformers' token_type_ids); with 1 every token
    gets its one row (a model with a single segment, e.g. RoBERTa's layout); with 0 there is none.
    """

    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        canonical_name(cfg.pe)
        self.embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype,
                              embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                                          ("vocab", "embed")))
        self.positional = make_positional(cfg.pe, cfg.positional_settings(), module_name=None)
        self.token_type = nn.Embed(cfg.type_vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype,
                                   embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                                               (None, "embed"))
                                   ) if cfg.type_vocab_size > 0 else None
        self.embed_ln = layer_norm(cfg, "embed_ln") if not cfg.causal else None
        self.final_ln = layer_norm(cfg, "final_ln") if cfg.causal else None
        self.blocks = [Block(cfg) for _ in range(cfg.num_layers)]
        self.dropout = make_dropout(cfg.dropout_rate, cfg.dropout_bits)

    def __call__(self, tokens: jax.Array, input_mask: Optional[jax.Array] = None, deterministic: bool = True,
                 position_offset: int = 0, return_hidden: bool = False, return_attention: bool = False,
                 segments: Optional[jax.Array] = None, last_rows: Optional[jax.Array] = None):
        """`last_rows` (B, P) (encoder): the last block at those positions only; x is then (B, P, d)."""
        cfg = self.cfg
        length = tokens.shape[1]
        terms = self.positional(length, position_offset)
        x = self.embed(tokens)
        if self.token_type is not None and segments is not None and cfg.type_vocab_size > 1:
            x = x + self.token_type(segments)
        elif self.token_type is not None:   # one segment: its row, added to every token
            x = x + self.token_type.embedding[0].astype(x.dtype)
        if terms.input_vector is not None:
            x = x + terms.input_vector[None].astype(x.dtype)
        if self.embed_ln is not None:
            x = self.embed_ln(x)
        x = constrain(self.dropout(x, deterministic=deterministic), ("batch", "length", "embed"))
        mask = attention_mask(input_mask, length, cfg.causal)
        causal_only = cfg.causal and input_mask is None   # the mask is the bare triangle (attention.fused_attention)
        hidden, attentions = [x], []
        for i, block in enumerate(self.blocks):
            rows = last_rows if i == len(self.blocks) - 1 else None
            x, probs = block(x, terms, mask, deterministic, return_attention, causal_only, rows)
            hidden.append(x)
            attentions.append(probs)
        if self.final_ln is not None:
            x = self.final_ln(x)
        extras = {}
        if return_hidden:
            extras["hidden_states"] = hidden
        if return_attention:
            extras["attentions"] = attentions
        return x, extras

    def attend(self, h: jax.Array) -> jax.Array:
        """Logits against the (tied) token embedding (`head.tied_logits`: nn.Embed.attend's maths)."""
        return tied_logits(h, self.embed.embedding, self.cfg.compute_dtype)

    def cross_entropy(self, h: jax.Array, bias: Optional[jax.Array], labels: jax.Array, weights: jax.Array):
        """(Σ w·NLL, Σ w·hit) of those logits (+ bias) (`head.tied_cross_entropy`)."""
        return tied_cross_entropy(h, self.embed.embedding, bias, labels, weights, self.cfg.compute_dtype)

    def positional_terms(self, length: int, position_offset: int = 0):
        """The scheme's terms for a given length (for analysis)."""
        return self.positional(length, position_offset)


class TransformerLM(nn.Module):
    """Encoder + MLM head (`mlm`) or decoder + LM head (`clm`).

    `mlm_positions` (B, P): run the MLM head only at those positions (the gather form); logits (B, P, V); with
    `last_layer_rows="predicted"` and P < L the last block too, unless hidden states or attentions are returned.
    Otherwise logits (B, L, V). Logits are float32.
    `segments` (B, L): segment ids for a model with segment embeddings (`Transformer`).
    `labels` and `label_weights` (B, P) or (B, L): return the loss sums instead of the logits, {'nll_sum':
    Σ w·NLL, 'correct': Σ w·(argmax = label)} (`head.tied_cross_entropy`: on CPU the logits are never stored).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, input_mask: Optional[jax.Array] = None,
                 mlm_positions: Optional[jax.Array] = None, deterministic: bool = True, position_offset: int = 0,
                 return_hidden: bool = False, return_attention: bool = False,
                 labels: Optional[jax.Array] = None, label_weights: Optional[jax.Array] = None,
                 segments: Optional[jax.Array] = None) -> dict:
        cfg = self.cfg
        encoder = Transformer(cfg, name="encoder")
        rows = mlm_positions if (cfg.last_layer_rows == "predicted" and mlm_positions is not None and not cfg.causal
                                 and mlm_positions.shape[1] < tokens.shape[1] and not return_hidden
                                 and not return_attention) else None
        h, extras = encoder(tokens, input_mask, deterministic, position_offset, return_hidden, return_attention,
                            segments, rows)
        if mlm_positions is not None and rows is None:
            h = constrain(jnp.take_along_axis(h, mlm_positions[..., None].astype(jnp.int32), axis=1),
                          ("batch", "length", "embed"))
        bias = None
        if not cfg.causal:
            h = dense(cfg.hidden_size, ("embed", "mlp"), cfg, "head_dense")(h)
            h = layer_norm(cfg, "head_ln")(gelu(h))
            bias = self.param("head_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                              (cfg.vocab_size,), jnp.float32)
        if labels is not None:
            nll_sum, correct = encoder.cross_entropy(h, bias, labels, label_weights)
            return {"nll_sum": nll_sum, "correct": correct, **extras}
        logits = encoder.attend(h).astype(jnp.float32)
        if bias is not None:
            logits = logits + bias
        return {"logits": logits, **extras}


class SequenceClassifier(nn.Module):
    """GLUE head: dense+tanh pooler on [CLS] (index 0) + dropout + linear; `num_labels=1` is regression."""

    cfg: ModelConfig
    num_labels: int

    @nn.compact
    def __call__(self, tokens: jax.Array, input_mask: Optional[jax.Array] = None,
                 deterministic: bool = True, segments: Optional[jax.Array] = None) -> jax.Array:
        """`segments` (B, L): 0 for [CLS] a [SEP], 1 for b [SEP] (`ClassificationBatch.segments`)."""
        cfg = self.cfg
        h, _ = Transformer(cfg, name="encoder")(tokens, input_mask, deterministic, segments=segments)
        pooled = jnp.tanh(dense(cfg.hidden_size, ("embed", "mlp"), cfg, "pooler")(h[:, 0]))
        pooled = make_dropout(cfg.dropout_rate, cfg.dropout_bits)(pooled, deterministic=deterministic)
        return dense(self.num_labels, ("mlp", None), cfg, "classifier")(pooled).astype(jnp.float32)


def count_params(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(nn.meta.unbox(params)))


def init_params(cfg: ModelConfig, rng: jax.Array, length: Optional[int] = None) -> dict:
    """Unboxed float32 params of a `TransformerLM` (CPU helper for tests and tools)."""
    tokens = jnp.zeros((1, length or min(cfg.max_len, 16)), jnp.int32)
    init = jax.jit(lambda key: nn.meta.unbox(TransformerLM(cfg).init({"params": key}, tokens)["params"]))
    return init(rng)
