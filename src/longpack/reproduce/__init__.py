"""Reproductions of the papers' experiments in the simulator: ``longpack reproduce skrull|chunkflow|hbp``."""
