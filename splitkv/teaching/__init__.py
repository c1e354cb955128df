"""Teaching helpers for the notebooks: the occupancy model, shared lesson code and exercise checkers.

Nothing on the production path imports this package.
"""
