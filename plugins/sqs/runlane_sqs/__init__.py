"""runlane-sqs: SQS wakeups for Runlane lanes that outgrow polling.

This distribution will hold the SQS transport and queue bindings, the wakeup envelope codec, the
Lambda handler helper, the long-running consumer and the ``postgres-sqs`` lane. Until then it only
reserves the package name and import path.
"""
