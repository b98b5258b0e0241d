"""Evaluation: zero-shot and retrieval tasks through lm-eval, and the analysis of SATFormer gates."""
