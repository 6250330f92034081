"""Training data: token streams cut into fixed-length samples and served as global batches."""
