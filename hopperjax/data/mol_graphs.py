"""Molecules as graphs for the DTA workload's graph encoder (``model.drug_encoder: gin``).

RDKit (the optional ``chem`` extra) parses each distinct SMILES once into fixed-size arrays, so
every batch has the same shapes and the step compiles once:

- ``atoms`` [max_atoms, len(ATOM_FEATURES)] uint8: per atom (the heavy atoms, and hydrogens only
  where the SMILES writes them as atoms, e.g. ``[2H]``) one small category per feature
  (the model sums one embedding per feature, the same as a linear layer over one-hot features);
  row ``i`` is RDKit's atom ``i``; padding rows are all zero (element 0 is "no atom").
- ``bonds`` [edge_slots(max_atoms), 3] int16: directed edges (source, target, bond type), each
  bond twice; padding rows are (-1, -1, 0).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from hopperjax.data.molecules import DataError

INSTALL_HINT = "pip install 'hopperjax[chem]' (RDKit)"

# (name, categories) of the atom features; a value past the last category is clipped into it.
ATOM_FEATURES = (
    ("element", 120),  # atomic number 1..119; 0 = padding
    ("degree", 7),  # heavy-atom neighbours, 6 and more in the last
    ("hydrogens", 5),  # attached hydrogens, implicit and explicit
    ("charge", 7),  # formal charge -3..+3, shifted to 0..6
    ("hybridization", 9),  # RDKit's HybridizationType value (UNSPECIFIED 0 .. OTHER 8)
    ("aromatic", 2),
    ("ring", 2),
)
BOND_TYPES = 4  # single, double, triple, aromatic (others count as single)


class TooLarge(DataError):
    """A molecule has more atoms or bonds than ``data.drug_max_atoms`` leaves room for."""


def edge_slots(max_atoms: int) -> int:
    """Directed-edge rows per molecule: each bond twice, and a heavy atom has at most 4 bonds on
    average in drug-like molecules (sulfur and phosphorus go higher, carbon and nitrogen lower),
    so 2 x 2 x atoms."""
    return 4 * max_atoms


@functools.cache
def rdkit_error() -> str | None:
    """None when RDKit imports, else why not (one line)."""
    try:
        from rdkit import Chem, RDLogger  # noqa: F401
    except ImportError as e:
        return (str(e).splitlines() or ["ImportError"])[0]
    return None


def _chem():
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")  # a bad SMILES is our DataError, not RDKit's log lines
    return Chem


def smiles_graph(smiles: str, max_atoms: int, *, where: str) -> tuple[np.ndarray, np.ndarray]:
    """One molecule -> (atoms [max_atoms, F] uint8, bonds [edge_slots, 3] int16).

    Args:
      where: names the record in errors, e.g. "ligands_can.txt: drug '11314340'".
    Raises:
      DataError: RDKit cannot parse the SMILES, or it has more atoms than ``max_atoms``
        (naming ``data.drug_max_atoms``) or more bonds than the edge slots.
    """
    chem = _chem()
    mol = chem.MolFromSmiles(smiles)
    if mol is None:
        raise DataError(f"{where}: RDKit cannot parse the SMILES {smiles[:80]!r}")
    n = mol.GetNumAtoms()
    if n > max_atoms:
        raise TooLarge(f"{where}: {n} atoms, more than data.drug_max_atoms={max_atoms}; raise it")
    atoms = np.zeros((max_atoms, len(ATOM_FEATURES)), np.uint8)
    limits = np.array([c - 1 for _, c in ATOM_FEATURES])
    for atom in mol.GetAtoms():
        values = (
            atom.GetAtomicNum(),
            atom.GetDegree(),
            atom.GetTotalNumHs(),
            atom.GetFormalCharge() + 3,
            int(atom.GetHybridization()),
            int(atom.GetIsAromatic()),
            int(atom.IsInRing()),
        )
        atoms[atom.GetIdx()] = np.clip(values, 0, limits)
    atoms[:n, 0] = np.maximum(atoms[:n, 0], 1)  # a dummy atom ("*", number 0) is still an atom
    slots = edge_slots(max_atoms)
    if 2 * mol.GetNumBonds() > slots:
        raise TooLarge(
            f"{where}: {mol.GetNumBonds()} bonds, more than data.drug_max_atoms={max_atoms} "
            f"leaves room for ({slots // 2}); raise it"
        )
    bonds = np.zeros((slots, 3), np.int16)
    bonds[:, :2] = -1
    kinds = {1.0: 0, 2.0: 1, 3.0: 2, 1.5: 3}
    for i, bond in enumerate(mol.GetBonds()):
        a, b = bond.GetBeginAtomIdx(), bond.GetEndAtomIdx()
        kind = kinds.get(bond.GetBondTypeAsDouble(), 0)
        bonds[2 * i] = (a, b, kind)
        bonds[2 * i + 1] = (b, a, kind)
    return atoms, bonds


def graph_table(
    smiles: Sequence[str], max_atoms: int, *, names: Sequence[str], source: str
) -> tuple[np.ndarray, np.ndarray]:
    """Every distinct drug -> (atoms [drugs, max_atoms, F], bonds [drugs, edge_slots, 3]).

    ``names``: the drugs' ids, for errors; ``source``: where they came from (a path)."""
    graphs = [
        smiles_graph(s, max_atoms, where=f"{source}: drug {name!r}")
        for s, name in zip(smiles, names, strict=True)
    ]
    if not graphs:
        slots = edge_slots(max_atoms)
        empty_atoms = np.zeros((0, max_atoms, len(ATOM_FEATURES)), np.uint8)
        return empty_atoms, np.zeros((0, slots, 3), np.int16)
    return np.stack([a for a, _ in graphs]), np.stack([b for _, b in graphs])
