"""Training: rendered pages, the nano definition, losses, the feature cache, evaluation and reading metrics (CER/WER), the training manifest, the quantizer trainer and the parity check."""
