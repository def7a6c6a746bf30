"""Metric of facts_gen.yaml: 1.0 when the reply contains the right answer (case-insensitive)."""


def contains_answer(references: list[str], predictions: list[str]) -> float:
    return float(references[0].lower() in predictions[0].lower())
