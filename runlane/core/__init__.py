"""The Runlane runtime: authoring definitions, cancellation, lane composition and the execution paths.

Modules here import ``runlane`` contracts and ``runlane.storage`` only; they never import a storage
driver, a transport provider or ``runlane_local``.
"""
