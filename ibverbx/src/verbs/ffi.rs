//! Hand-written `#[repr(C)]` mirrors of the rdma-core (`<infiniband/verbs.h>`)
//! types and constants the verbs provider uses.
//!
//! Only what the provider touches is declared; structs that libibverbs
//! allocates (`ibv_context`, `ibv_cq`, `ibv_qp`, …) are declared up to and
//! including the last field read here, plus the rest where the size matters.
//! Field meanings are those of `verbs.h`; the names are kept identical so
//! the layout tests (`tests/verbs_layout.rs`, against `rdma-sys` bindgen
//! output, and the unit tests below, against the sizes and offsets a C
//! compiler gives for rdma-core 44 on x86_64) can name them.
//!
//! What may change this file: an rdma-core ABI change, which the layout tests
//! catch before anything touches memory.

// The names and shapes are verbs.h's; documenting each field again would only
// restate the header.
#![allow(missing_docs, non_camel_case_types, missing_debug_implementations)]

use std::os::raw::{c_char, c_int, c_uint, c_void};

/// `union ibv_gid`: 16 raw bytes (the `global` view is not needed, but its
/// two `__be64` give the union 8-byte alignment).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

pub const IBV_GID_TYPE_IB: u32 = 0;
pub const IBV_GID_TYPE_ROCE_V1: u32 = 1;
pub const IBV_GID_TYPE_ROCE_V2: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_uint,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr`. The exported `ibv_query_port@IBVERBS_1.1` fills
/// the fields up to `flags` (its `_compat_ibv_port_attr`); the rest stays as
/// the caller zeroed it.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

pub const IBV_PORT_DOWN: c_uint = 1;
pub const IBV_PORT_INIT: c_uint = 2;
pub const IBV_PORT_ARMED: c_uint = 3;
pub const IBV_PORT_ACTIVE: c_uint = 4;
pub const IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

/// `struct ibv_wc`; `imm_data` is the `imm_data`/`invalidated_rkey` union.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

pub const IBV_WC_SEND: c_uint = 0;
pub const IBV_WC_RDMA_WRITE: c_uint = 1;
pub const IBV_WC_RDMA_READ: c_uint = 2;
pub const IBV_WC_COMP_SWAP: c_uint = 3;
pub const IBV_WC_FETCH_ADD: c_uint = 4;
pub const IBV_WC_RECV: c_uint = 1 << 7;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_uint = (1 << 7) + 1;
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

pub const IBV_QPT_RC: c_uint = 2;

pub const IBV_QPS_RESET: c_uint = 0;
pub const IBV_QPS_INIT: c_uint = 1;
pub const IBV_QPS_RTR: c_uint = 2;
pub const IBV_QPS_RTS: c_uint = 3;
pub const IBV_QPS_SQD: c_uint = 4;
pub const IBV_QPS_SQE: c_uint = 5;
pub const IBV_QPS_ERR: c_uint = 6;

pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
pub const IBV_WR_SEND: c_uint = 2;
pub const IBV_WR_SEND_WITH_IMM: c_uint = 3;
pub const IBV_WR_RDMA_READ: c_uint = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: c_uint = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: c_uint = 6;

pub const IBV_SEND_FENCE: c_uint = 1 << 0;
pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;
pub const IBV_SEND_INLINE: c_uint = 1 << 3;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The `rdma` member of `ibv_send_wr`'s `wr` union.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// The `atomic` member of `ibv_send_wr`'s `wr` union (its largest member).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `ibv_send_wr`'s `wr` union (the `ud` member is not used by RC QPs).
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
}

/// `struct ibv_send_wr`. `imm_data` is the `imm_data`/`invalidate_rkey`
/// union; `qp_type` and `bind_mw` stand for the XRC and MW/TSO unions that RC
/// QPs leave zeroed.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    pub qp_type: u32,
    pub bind_mw: [u64; 6],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// An entry of `ibv_context_ops` this provider never calls.
pub type unused_op = Option<unsafe extern "C" fn()>;
pub type poll_cq_fn = unsafe extern "C" fn(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int;
pub type req_notify_cq_fn = unsafe extern "C" fn(cq: *mut ibv_cq, solicited_only: c_int) -> c_int;
pub type post_send_fn =
    unsafe extern "C" fn(qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad_wr: *mut *mut ibv_send_wr) -> c_int;
pub type post_recv_fn =
    unsafe extern "C" fn(qp: *mut ibv_qp, wr: *mut ibv_recv_wr, bad_wr: *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`: the data-path entries that verbs.h's inline
/// `ibv_poll_cq`, `ibv_req_notify_cq`, `ibv_post_send` and `ibv_post_recv`
/// call through.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: unused_op,
    pub _compat_query_port: unused_op,
    pub _compat_alloc_pd: unused_op,
    pub _compat_dealloc_pd: unused_op,
    pub _compat_reg_mr: unused_op,
    pub _compat_rereg_mr: unused_op,
    pub _compat_dereg_mr: unused_op,
    pub alloc_mw: unused_op,
    pub bind_mw: unused_op,
    pub dealloc_mw: unused_op,
    pub _compat_create_cq: unused_op,
    pub poll_cq: Option<poll_cq_fn>,
    pub req_notify_cq: Option<req_notify_cq_fn>,
    pub _compat_cq_event: unused_op,
    pub _compat_resize_cq: unused_op,
    pub _compat_destroy_cq: unused_op,
    pub _compat_create_srq: unused_op,
    pub _compat_modify_srq: unused_op,
    pub _compat_query_srq: unused_op,
    pub _compat_destroy_srq: unused_op,
    pub post_srq_recv: unused_op,
    pub _compat_create_qp: unused_op,
    pub _compat_query_qp: unused_op,
    pub _compat_modify_qp: unused_op,
    pub _compat_destroy_qp: unused_op,
    pub post_send: Option<post_send_fn>,
    pub post_recv: Option<post_recv_fn>,
    pub _compat_create_ah: unused_op,
    pub _compat_destroy_ah: unused_op,
    pub _compat_attach_mcast: unused_op,
    pub _compat_detach_mcast: unused_op,
    pub _compat_async_event: unused_op,
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

/// `struct ibv_device`; `_ops` is `struct _ibv_device_ops` (two pointers).
#[repr(C)]
pub struct ibv_device {
    pub _ops: [*mut c_void; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod tests {
    //! Sizes and offsets as gcc reports them for rdma-core 44's verbs.h on
    //! x86_64 (a C program printing `sizeof`/`offsetof`); the `rdma-sys`
    //! feature adds the comparison against bindgen in `tests/verbs_layout.rs`.
    use std::mem::{offset_of, size_of};

    use super::*;

    #[test]
    fn sizes_match_verbs_h() {
        assert_eq!(size_of::<ibv_device_attr>(), 232);
        assert_eq!(size_of::<ibv_port_attr>(), 52);
        assert_eq!(size_of::<ibv_gid_entry>(), 32);
        assert_eq!(size_of::<ibv_wc>(), 48);
        assert_eq!(size_of::<ibv_pd>(), 16);
        assert_eq!(size_of::<ibv_mr>(), 48);
        assert_eq!(size_of::<ibv_global_route>(), 24);
        assert_eq!(size_of::<ibv_ah_attr>(), 32);
        assert_eq!(size_of::<ibv_qp_cap>(), 20);
        assert_eq!(size_of::<ibv_qp_init_attr>(), 64);
        assert_eq!(size_of::<ibv_qp_attr>(), 144);
        assert_eq!(size_of::<ibv_sge>(), 16);
        assert_eq!(size_of::<ibv_send_wr>(), 128);
        assert_eq!(size_of::<ibv_recv_wr>(), 32);
        assert_eq!(size_of::<ibv_qp>(), 160);
        assert_eq!(size_of::<ibv_comp_channel>(), 16);
        assert_eq!(size_of::<ibv_cq>(), 128);
        assert_eq!(size_of::<ibv_context_ops>(), 256);
        assert_eq!(size_of::<ibv_context>(), 328);
        assert_eq!(size_of::<ibv_device>(), 664);
    }

    #[test]
    fn offsets_match_verbs_h() {
        assert_eq!(offset_of!(ibv_device_attr, max_mr_size), 80);
        assert_eq!(offset_of!(ibv_device_attr, max_qp), 108);
        assert_eq!(offset_of!(ibv_device_attr, max_qp_wr), 112);
        assert_eq!(offset_of!(ibv_device_attr, max_sge), 120);
        assert_eq!(offset_of!(ibv_device_attr, max_cqe), 132);
        assert_eq!(offset_of!(ibv_device_attr, max_mr), 136);
        assert_eq!(offset_of!(ibv_device_attr, max_qp_rd_atom), 144);
        assert_eq!(offset_of!(ibv_device_attr, max_qp_init_rd_atom), 156);
        assert_eq!(offset_of!(ibv_device_attr, max_pkeys), 224);
        assert_eq!(offset_of!(ibv_device_attr, phys_port_cnt), 227);
        assert_eq!(offset_of!(ibv_port_attr, max_msg_sz), 20);
        assert_eq!(offset_of!(ibv_port_attr, lid), 34);
        assert_eq!(offset_of!(ibv_port_attr, active_width), 43);
        assert_eq!(offset_of!(ibv_port_attr, active_speed), 44);
        assert_eq!(offset_of!(ibv_port_attr, link_layer), 46);
        assert_eq!(offset_of!(ibv_port_attr, port_cap_flags2), 48);
        assert_eq!(offset_of!(ibv_wc, status), 8);
        assert_eq!(offset_of!(ibv_wc, byte_len), 20);
        assert_eq!(offset_of!(ibv_wc, imm_data), 24);
        assert_eq!(offset_of!(ibv_wc, qp_num), 28);
        assert_eq!(offset_of!(ibv_wc, wc_flags), 36);
        assert_eq!(offset_of!(ibv_wc, sl), 44);
        assert_eq!(offset_of!(ibv_mr, lkey), 36);
        assert_eq!(offset_of!(ibv_mr, rkey), 40);
        assert_eq!(offset_of!(ibv_global_route, sgid_index), 20);
        assert_eq!(offset_of!(ibv_ah_attr, dlid), 24);
        assert_eq!(offset_of!(ibv_ah_attr, is_global), 29);
        assert_eq!(offset_of!(ibv_ah_attr, port_num), 30);
        assert_eq!(offset_of!(ibv_qp_init_attr, cap), 32);
        assert_eq!(offset_of!(ibv_qp_init_attr, qp_type), 52);
        assert_eq!(offset_of!(ibv_qp_init_attr, sq_sig_all), 56);
        assert_eq!(offset_of!(ibv_qp_attr, cap), 36);
        assert_eq!(offset_of!(ibv_qp_attr, ah_attr), 56);
        assert_eq!(offset_of!(ibv_qp_attr, alt_ah_attr), 88);
        assert_eq!(offset_of!(ibv_qp_attr, pkey_index), 120);
        assert_eq!(offset_of!(ibv_qp_attr, max_rd_atomic), 126);
        assert_eq!(offset_of!(ibv_qp_attr, timeout), 130);
        assert_eq!(offset_of!(ibv_qp_attr, rnr_retry), 132);
        assert_eq!(offset_of!(ibv_qp_attr, rate_limit), 136);
        assert_eq!(offset_of!(ibv_send_wr, opcode), 28);
        assert_eq!(offset_of!(ibv_send_wr, send_flags), 32);
        assert_eq!(offset_of!(ibv_send_wr, imm_data), 36);
        assert_eq!(offset_of!(ibv_send_wr, wr), 40);
        assert_eq!(offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_atomic, rkey), 64);
        assert_eq!(offset_of!(ibv_send_wr, qp_type), 72);
        assert_eq!(offset_of!(ibv_send_wr, bind_mw), 80);
        assert_eq!(offset_of!(ibv_qp, handle), 48);
        assert_eq!(offset_of!(ibv_qp, qp_num), 52);
        assert_eq!(offset_of!(ibv_qp, state), 56);
        assert_eq!(offset_of!(ibv_qp, mutex), 64);
        assert_eq!(offset_of!(ibv_qp, events_completed), 152);
        assert_eq!(offset_of!(ibv_comp_channel, fd), 8);
        assert_eq!(offset_of!(ibv_cq, cqe), 28);
        assert_eq!(offset_of!(ibv_cq, mutex), 32);
        assert_eq!(offset_of!(ibv_context_ops, poll_cq), 88);
        assert_eq!(offset_of!(ibv_context_ops, req_notify_cq), 96);
        assert_eq!(offset_of!(ibv_context_ops, post_send), 200);
        assert_eq!(offset_of!(ibv_context_ops, post_recv), 208);
        assert_eq!(offset_of!(ibv_context, ops), 8);
        assert_eq!(offset_of!(ibv_context, cmd_fd), 264);
        assert_eq!(offset_of!(ibv_context, mutex), 280);
        assert_eq!(offset_of!(ibv_context, abi_compat), 320);
        assert_eq!(offset_of!(ibv_device, node_type), 16);
        assert_eq!(offset_of!(ibv_device, name), 24);
        assert_eq!(offset_of!(ibv_device, dev_name), 88);
        assert_eq!(offset_of!(ibv_device, dev_path), 152);
        assert_eq!(offset_of!(ibv_device, ibdev_path), 408);
    }
}
