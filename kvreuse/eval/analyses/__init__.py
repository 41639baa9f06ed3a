"""Analyses that reproduce the papers' observations on the loaded model (`kvreuse analyze NAME`), each writing
a PNG and a JSON of its numbers: see docs/ANALYSES.md."""
