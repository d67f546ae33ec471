"""Cluster profiles: a strict schema, a search path, ``extends:`` and overrides.

Public API (other layers depend on it): ``load_profile``, ``list_profiles``,
``Profile`` and its sections, ``search_path``.
"""
from hpc_verl.profiles.loader import ProfileInfo, list_profiles, load_profile, parse_override, search_path
from hpc_verl.profiles.schema import (ContainerSection, EnvSection, NetworkSection, PathsSection, Profile,
                                      RaySection, SlurmSection, parse_size_bytes, schema_fields)

__all__ = ["load_profile", "list_profiles", "search_path", "parse_override", "ProfileInfo", "Profile",
           "SlurmSection", "ContainerSection", "NetworkSection", "EnvSection", "RaySection", "PathsSection",
           "parse_size_bytes", "schema_fields"]
