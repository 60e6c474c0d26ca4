"""Readers and writers for the formats users bring: pairs, RNA matrices, annotations, sheets."""
