"""ggml golden op outputs (data only; see README.md). A package so its files ship as package data."""
