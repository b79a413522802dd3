"""Tenants' limits: token buckets, where their state lives, and admission against them."""
