"""The generation loop every mode runs: rounds, fault links, TAPS feedback."""
