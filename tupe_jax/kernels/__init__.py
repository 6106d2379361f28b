"""Hand-written kernels: the pieces XLA cannot fuse by itself.

- `threefry.py`: Threefry-2x32-20 as plain uint32 array operations (usable inside a Pallas kernel), bit for bit
  `jax.extend.random.threefry2x32_p`;
- `flash.py`: a Pallas flash-attention kernel (Triton on GPU) with the positional bias, a mask and 16-bit
  attention dropout whose masks are exactly `dropout.keep_mask16`'s: `model.attention_backend=pallas`;
- `masks.py`: where a tile of its dropout mask comes from: bytes precomputed by XLA (`dropout.keep_bits16`), or
  hashed in the kernel;
- `calls.py`: its pallas_call plumbing (BlockSpecs, absent inputs, Triton's launch settings).
"""
