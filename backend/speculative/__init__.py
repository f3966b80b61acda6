"""Speculative decoding: proposers that guess a row's next tokens from what it (and other requests) produced."""
