"""Analysis of trained runs, and the comparison suites that train runs to analyse.

Each tool is a pure function of in-memory runs (`common.Run` = `workdir.LoadedRun`) plus a thin
`run(workdir, ...)` wrapper that loads runs from disk and writes JSON + PNG atomically:

  extrapolate   perplexity (CLM) / MLM loss vs evaluation length; nonoverlapping or sliding windows
  probe         2-layer ReLU MLP probes predicting absolute position from each layer's frozen hidden states
  correlations  the attention-logit decomposition (TUPE Fig. 2) and TUPE's learned positional correlation (Fig. 6)
  shuffle       attention maps of a sentence and of its shuffle (NoPos), with the permutation-equivariance gap
  suite         `launch compare`: train a suite's schemes (pretrain/, finetune/), run its analyses
  report        the suite's REPORT.md and plots (also re-rendered from report.json)

Modules are imported lazily by the launcher; importing this package imports nothing heavy.
"""
