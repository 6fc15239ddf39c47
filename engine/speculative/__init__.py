"""Speculative decoding: proposers (``ngram``) and the verification's rejection sampling (``rejection``)."""
