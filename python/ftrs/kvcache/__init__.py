"""Paged KV memory: the page pool and the radix prefix cache over it."""
