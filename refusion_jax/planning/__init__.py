"""Planning ReFusion's slot order beyond a threshold (ALGORITHM.md "Past the paper")."""
