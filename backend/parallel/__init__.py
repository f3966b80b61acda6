"""Tensor parallelism: one model's heads, MLP columns and vocabulary split over the processes of one host."""
