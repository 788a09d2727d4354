"""The stack file and what it means, offline: the validated model (model), instance-type facts (catalog), EKS facts
(eks) and prices (cost). Imports the contract and itself only."""
