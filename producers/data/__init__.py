"""Small data files shipped with rollq (the GSM8K-format sample) and their generator."""
