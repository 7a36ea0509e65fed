"""Molecules as graphs for the DTA workload's graph encoder (``model.drug_encoder: gin``).

RDKit (the optional ``chem`` extra) parses each distinct SMILES once into fixed-size arrays, so
every batch has the same shapes and the step compiles once:

- ``atoms`` [max_atoms, len(ATOM_FEATURES)] uint8: per atom (the heavy atoms, and hydrogens only
  where the SMILES writes them as atoms, e.g. ``[2H]``) one small category per feature
  (the model sums one embedding per feature, the same as a linear layer over one-hot features);
  row ``i`` is RDKit's atom ``i``; padding rows are all zero (element 0 is "no atom").
- ``bonds`` [edge_slots(max_atoms), 3] int16: directed edges (source, target, bond type), each
  bond twice; padding rows are (-1, -1, 0).

A batch's distinct drugs travel as one graph (``batch_graph``): their atoms and bonds in flat
arrays of a fixed number of slots, with each atom's table row. ``packed``: each molecule's atoms
right after the previous one's, so the slots are what the data's largest molecules need
(``slot_budget``; on Davis 2,180 atoms and 4,820 directed bonds for all 68 drugs, against 6,912
and 27,648 slots at 96 atoms a molecule); not packed: molecule ``r`` at atom slot
``r * max_atoms`` and bond slot ``r * edge_slots(max_atoms)``, every molecule padded to the
largest allowed (the layout before packing, kept as the reference).
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


def graph_sizes(atoms: np.ndarray, bonds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per molecule of a ``graph_table``: (atoms, directed bonds), int64 each. Real atoms and
    bonds come first in their rows (``smiles_graph``)."""
    return (atoms[..., 0] > 0).sum(axis=-1), (bonds[..., 0] >= 0).sum(axis=-1)


def padded_slots(rows: int, max_atoms: int) -> tuple[int, int]:
    """(atom, bond) slots of ``rows`` molecules, each given room for the largest allowed."""
    return rows * max_atoms, rows * edge_slots(max_atoms)


def slot_budget(sizes: np.ndarray, molecules: int, *, distinct: bool, multiple: int) -> int:
    """Slots that hold any ``molecules`` of the data's (``sizes``: atoms, or bonds, of each):
    the largest ``molecules`` sizes summed when a batch's molecules are distinct, else
    ``molecules`` times the largest; rounded up to ``multiple`` (at least one ``multiple``)."""
    sizes = np.sort(np.asarray(sizes, np.int64))[::-1]
    top = int(sizes[:molecules].sum()) if distinct else molecules * int(sizes.max(initial=0))
    return max(1, -(-top // multiple)) * multiple


def batch_graph(
    ids: np.ndarray,
    rows: int,
    *,
    graphs: tuple[np.ndarray, np.ndarray],
    sizes: tuple[np.ndarray, np.ndarray],
    atom_slots: int,
    bond_slots: int,
    packed: bool,
) -> dict[str, np.ndarray]:
    """The molecules ``ids`` (table rows 0..len(ids)-1 of ``rows``) as one graph.

    Args:
      graphs: ``graph_table``'s (atoms, bonds); sizes: its ``graph_sizes``.
    Returns:
      {"drug_atoms": [atom_slots, F] uint8 (padding slots all zero), "drug_bonds": [bond_slots,
      3] int32 (source and target atom slots, bond type; padding (-1, -1, 0)), "drug_graph":
      [atom_slots] int32 (each atom's table row; -1 for padding slots), "drug_sizes": [rows]
      int32 (atoms per table row, 0 for padding rows)}.
    Raises:
      ValueError: the molecules need more slots than given (a budget from other data).
    """
    atoms, bonds = graphs
    ids = np.asarray(ids, np.int64)
    n_atoms, n_bonds = sizes[0][ids], sizes[1][ids]
    if packed:
        atom_start = np.cumsum(n_atoms) - n_atoms
        bond_start = np.cumsum(n_bonds) - n_bonds
    else:
        atom_start = np.arange(len(ids)) * atoms.shape[1]
        bond_start = np.arange(len(ids)) * bonds.shape[1]
    ends = (atom_start[-1] + n_atoms[-1], bond_start[-1] + n_bonds[-1]) if len(ids) else (0, 0)
    if len(ids) > rows or ends[0] > atom_slots or ends[1] > bond_slots:
        raise ValueError(
            f"{len(ids)} molecules of {n_atoms.sum()} atoms and {n_bonds.sum()} bonds do not fit "
            f"{rows} rows, {atom_slots} atom slots and {bond_slots} bond slots"
        )
    # Each molecule's i-th real atom (bond): row in the table of molecules, slot in the batch.
    mol_of_atom = np.repeat(np.arange(len(ids)), n_atoms)
    atom_in_mol = np.arange(len(mol_of_atom)) - np.repeat(np.cumsum(n_atoms) - n_atoms, n_atoms)
    mol_of_bond = np.repeat(np.arange(len(ids)), n_bonds)
    bond_in_mol = np.arange(len(mol_of_bond)) - np.repeat(np.cumsum(n_bonds) - n_bonds, n_bonds)
    atom_slot = atom_start[mol_of_atom] + atom_in_mol
    bond_slot = bond_start[mol_of_bond] + bond_in_mol

    out_atoms = np.zeros((atom_slots, atoms.shape[-1]), np.uint8)
    out_atoms[atom_slot] = atoms[ids[mol_of_atom], atom_in_mol]
    graph = np.full(atom_slots, -1, np.int32)
    graph[atom_slot] = mol_of_atom
    out_bonds = np.zeros((bond_slots, 3), np.int32)
    out_bonds[:, :2] = -1
    picked = bonds[ids[mol_of_bond], bond_in_mol].astype(np.int32)
    out_bonds[bond_slot, :2] = picked[:, :2] + atom_start[mol_of_bond, None]
    out_bonds[bond_slot, 2] = picked[:, 2]
    count = np.zeros(rows, np.int32)
    count[: len(ids)] = n_atoms
    return {
        "drug_atoms": out_atoms,
        "drug_bonds": out_bonds,
        "drug_graph": graph,
        "drug_sizes": count,
    }
