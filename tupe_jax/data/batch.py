"""The batch types that flow from the data layer through both loops, evaluation and analysis.

Both are frozen dataclasses registered as pytrees (`flax.struct.dataclass`), so a batch goes through `jax.jit`,
`sharding.global_batch` and `optim.split_microbatches` as it is; fields that a batch kind does not use are None
(an empty subtree). Shapes use B = rows (host-local in the data layer, global after `sharding.global_batch`),
L = padded length, P = MLM prediction slots (`data.max_predictions`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from flax import struct

Array = Any   # np.ndarray in the data layer, jax.Array after `sharding.global_batch`


@struct.dataclass
class LMBatch:
    """A pretraining batch, MLM (`objective=mlm`) or causal LM (`objective=clm`).

    inputs          (B, L) int32   what the model reads: MLM = [CLS] + text with masked tokens replaced
                                   (80 % [MASK], 10 % random, 10 % kept); CLM = the text
    targets         (B, L) int32   MLM: the unmasked tokens; CLM: the next token at each position
    weights         (B, L) float32 1 where a target counts (MLM: the masked positions; CLM: real next tokens)
    input_mask      (B, L) int32   MLM only: 1 = real token, 0 = padding (the causal mask needs none)
    mlm_positions   (B, P) int32   MLM only: the masked positions, ascending, padded with 0
    mlm_labels      (B, P) int32   MLM only: the original token at each masked position
    mlm_weights     (B, P) float32 MLM only: 1 for a real slot, 0 for padding
    """
    inputs: Array
    targets: Array
    weights: Array
    input_mask: Optional[Array] = None
    mlm_positions: Optional[Array] = None
    mlm_labels: Optional[Array] = None
    mlm_weights: Optional[Array] = None

    @property
    def is_mlm(self) -> bool:
        return self.mlm_positions is not None

    def present(self) -> dict[str, Array]:
        """The fields that are set (not None), by name: for logging, debugging and tests."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@struct.dataclass
class ClassificationBatch:
    """A sentence(-pair) classification or regression batch (GLUE, word order): [CLS] a [SEP] (b [SEP]).

    inputs          (B, L) int32   token ids, padded with [PAD]
    input_mask      (B, L) int32   1 = real token
    segments        (B, L) int32   0 for [CLS] a [SEP] and padding, 1 for b [SEP] (BERT's token types)
    label           (B,)   int32 class (float32 for regression: STS-B); 0 in padding rows
    example_index   (B,)   int32   the example's position in its split; -1 for padding rows
    example_weight  (B,)   float32 1 for a real example, 0 for a padding row
    """
    inputs: Array
    input_mask: Array
    label: Array
    example_index: Array
    example_weight: Array
    segments: Optional[Array] = None

    def present(self) -> dict[str, Array]:
        """The fields that are set (not None), by name: for logging, debugging and tests."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
