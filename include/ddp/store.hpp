#pragma once
/// \file store.hpp
/// The TCP key-value store that rank 0 hosts during and after rendezvous: set, get (waits),
/// add, compare-and-set, delete, check and wait-for-keys, each with a deadline. With an
/// authenticator (docs/security.md) every connection must pass a mutual challenge-response
/// before its first request is read. The server (group/store_server.hpp) and the client
/// (group/store_client.hpp) have a header each.
///
/// \code
/// ddp::store_server server{ddp::endpoint{"127.0.0.1", 0}, 0};
/// ddp::store_client c{"127.0.0.1", server.port(), 0, deadline};
/// c.set("k", "v");
/// auto v = c.get("k", deadline);
/// \endcode

#include <ddp/group/store_client.hpp>  // IWYU pragma: export
#include <ddp/group/store_server.hpp>  // IWYU pragma: export
