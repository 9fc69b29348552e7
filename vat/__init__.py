"""vat: verification-aware training of speculative-decoding drafts for Mixture-of-Experts targets."""

__version__ = "0.1.0"
