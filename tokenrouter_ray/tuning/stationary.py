"""Long-run distribution of a finite Markov chain given as a sparse row-stochastic matrix.

``stationary(P, start)`` returns the limiting (Cesàro) distribution of the chain started in
state ``start``: transient states get probability 0, and each closed (recurrent) class gets
its own stationary vector weighted by the probability of being absorbed into it. With the one
closed class an irreducible routing matrix gives, the result is the usual ``pi P = pi``.

Per closed class, ``pi (I - P) = 0`` is solved by Gauss-Seidel sweeps in the state order the
caller gives (fast when transitions mostly point forward in that order); if that does not
converge, by a sparse LU with one balance equation replaced by ``sum(pi) = 1``.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.csgraph as csgraph
import scipy.sparse.linalg as spla

RESIDUAL_TOLERANCE = 1e-9  # L1 norm of pi (I - P) accepted from the iterative solve
SWEEP_TOLERANCE = 1e-13  # L1 change between Gauss-Seidel sweeps that ends the iteration
MAX_SWEEPS = 500


def _closed_classes(transition: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
    """Strong-component labels and the boolean 'closed' flag per component."""
    count, labels = csgraph.connected_components(transition, directed=True, connection="strong")
    coo = transition.tocoo()
    leaving = labels[coo.row] != labels[coo.col]
    closed = np.ones(count, dtype=bool)
    closed[labels[coo.row[leaving]]] = False
    return labels, closed


def _gauss_seidel(block: sp.csr_matrix) -> np.ndarray | None:
    """Gauss-Seidel sweeps on ``(I - P^T) pi = 0`` in the given state order, or None.

    The chain builder numbers states in breadth-first order from the start state, so almost
    every transition points forward and a sweep (one sparse triangular solve) carries
    probability mass along whole batch cycles: a handful of sweeps reach 1e-13.
    """
    n = block.shape[0]
    system = (sp.identity(n, format="csr") - block.T).tocsr()
    upper = sp.triu(system, k=1, format="csr")
    # A triangular matrix factors as itself under the natural order with no pivoting, so
    # SuperLU's triangular solves are reused for every sweep.
    lower = spla.splu(
        sp.tril(system, format="csc"),
        permc_spec="NATURAL",
        diag_pivot_thresh=0.0,
        options={"SymmetricMode": True},
    )
    pi = np.full(n, 1.0 / n)
    for _ in range(MAX_SWEEPS):
        new = lower.solve(-(upper @ pi))
        new /= new.sum()
        change = np.abs(new - pi).sum()
        pi = new
        if change < SWEEP_TOLERANCE:
            break
    if not np.isfinite(pi).all() or np.abs(system @ pi).sum() > RESIDUAL_TOLERANCE:
        return None
    return pi


def _direct(block: sp.csr_matrix) -> np.ndarray:
    """Sparse LU on the balance equations with one replaced by ``sum(pi) = 1``."""
    n = block.shape[0]
    system = (block.T - sp.identity(n, format="csr")).tolil()
    system[n - 1, :] = np.ones(n)
    system = system.tocsc()
    rhs = np.zeros(n)
    rhs[n - 1] = 1.0
    pi = spla.splu(system, permc_spec="MMD_AT_PLUS_A").solve(rhs)
    if np.abs(system @ pi - rhs).max() > RESIDUAL_TOLERANCE:
        pi, _ = spla.gmres(system, rhs, x0=pi, rtol=1e-12, restart=50, maxiter=200)
    return pi


def _solve_class(block: sp.csr_matrix) -> np.ndarray:
    """Stationary vector of an irreducible stochastic matrix."""
    if block.shape[0] == 1:
        return np.ones(1)
    pi = _gauss_seidel(block)
    if pi is None:
        pi = _direct(block)
    pi = np.clip(pi, 0.0, None)
    return pi / pi.sum()


def _absorption(
    transition: sp.csr_matrix, start: int, labels: np.ndarray, closed: np.ndarray
) -> dict[int, float]:
    """Probability that the chain from ``start`` ends in each closed component."""
    in_closed = closed[labels]
    if closed.sum() == 1:
        return {int(np.flatnonzero(closed)[0]): 1.0}
    if in_closed[start]:
        return {int(labels[start]): 1.0}
    transient = np.flatnonzero(~in_closed)
    where = np.full(labels.size, -1)
    where[transient] = np.arange(transient.size)
    inner = transition[transient][:, transient]
    system = (sp.identity(transient.size, format="csc") - inner).tocsc()
    lu = spla.splu(system)
    out_rows = transition[transient]
    result = {}
    for comp in np.flatnonzero(closed):
        members = labels == comp
        rhs = np.asarray(out_rows[:, members].sum(axis=1)).ravel()
        if rhs.any():
            result[int(comp)] = float(lu.solve(rhs)[where[start]])
    return result


def stationary(transition: sp.csr_matrix, start: int = 0) -> np.ndarray:
    """Limiting distribution of the chain started at ``start``: (S,) summing to 1."""
    labels, closed = _closed_classes(transition)
    pi = np.zeros(transition.shape[0])
    for comp, weight in _absorption(transition, start, labels, closed).items():
        members = np.flatnonzero(labels == comp)
        if members.size == transition.shape[0]:
            pi[:] = _solve_class(transition)
            break
        block = transition[members][:, members]
        pi[members] = weight * _solve_class(block.tocsr())
    return pi / pi.sum()
