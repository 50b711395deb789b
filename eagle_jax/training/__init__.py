"""Training, independent of the drafter kind: ShareGPT data, target feature caches, and the
resumable trainer that runs a drafter's training task."""
