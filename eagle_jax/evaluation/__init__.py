"""Evaluation: prompts, the experiment runner and its records, summaries and paper-style
tables, and the benchmarks (``bench decode``; ``bench spec`` is a front end of the runner)."""
