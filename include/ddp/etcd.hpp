#pragma once
/// \file etcd.hpp
/// The etcd backend of the group's store (group/etcd_store.hpp): include it, link libcurl, and
/// `DDP_STORE=etcd://h1:2379,h2:2379,h3:2379[/prefix]` (or init_options::store_url) puts the
/// group's store, and with it the control plane of plain and elastic groups, on an etcd
/// cluster. Optional like ddp's other dependencies: <ddp/ddp.hpp> never includes it.
/// docs/cluster.md.

#include <ddp/group/etcd_store.hpp>  // IWYU pragma: export
