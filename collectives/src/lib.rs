//! rmacomm collectives: every collective written on one-sided windows.
//!
//! It will hold `Comm` with broadcast, all_reduce, all_gather, reduce_scatter, all_to_all and the rest, with algorithm choice by size and world size, and NCCL/RCCL fallback backends loaded at run time. Nothing is implemented yet.

#![forbid(unsafe_code)]
