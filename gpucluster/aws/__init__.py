"""What runs with the caller's AWS credentials through boto3: preflight, spend, leftovers, and the teardown steps of
`pulumi destroy` (run by the dynamic provider in components.teardown). Imports the contract and the spec."""
