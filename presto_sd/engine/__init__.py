"""The engine contracts: the Drafter and Verifier interfaces, their results, errors, sessions."""
