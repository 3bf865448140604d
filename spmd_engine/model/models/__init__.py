"""Whole decoder models built from the parallel layers."""
