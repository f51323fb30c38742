"""Runtime: executes Plans with PyTorch (imported only on demand; the core never imports torch)."""
