"""Evaluation: what the evaluate step measures and when it runs.

accuracy    greedy accuracy of a weights version on the held-out sets, pass@k, the eval samples
cadence     when the loop evaluates and when its eval gate stops it (torch-free)
harness     EleutherAI's lm-evaluation-harness on a weights version (the `harness` extra)
"""
