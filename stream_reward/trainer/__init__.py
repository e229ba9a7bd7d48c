"""The trainer side: declare batches, push trajectories, await results, build rm_scores."""
