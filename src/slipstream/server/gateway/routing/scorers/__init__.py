"""The scorers, one module each; :mod:`..registry` names them for profiles and weights."""
