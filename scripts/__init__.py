"""Developer scripts: `python -m scripts.serve` starts tritonserver with the Tandem model repository."""
