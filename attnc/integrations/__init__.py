"""Integrations of attnc with other libraries.

``import attnc.integrations.transformers`` registers attnc as a Hugging Face transformers attention
implementation (``attn_implementation="attnc"``).  Nothing here is imported by ``import attnc``.
"""
