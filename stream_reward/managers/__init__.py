"""Managers by verl's names (registry) and the layers they stack around a scorer (layers)."""
