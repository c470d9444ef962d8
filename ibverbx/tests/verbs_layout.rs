//! Layout of the verbs provider's hand-written FFI structs against
//! `rdma-sys` (bindgen over the installed `<infiniband/verbs.h>`; for
//! `ibv_wc`, `ibv_send_wr`, `ibv_ah_attr`, `ibv_global_route` and `ibv_gid`
//! rdma-sys has hand-written definitions of its own, which the size and
//! offset checks in `src/verbs/ffi.rs` pin against a C compiler's numbers).
//!
//! Needs the `rdma-sys` feature (libibverbs-dev, librdmacm-dev and libclang
//! at build time):
//! `cargo test -p ibverbx --release --features rdma-sys --test verbs_layout`.

#[cfg(not(feature = "rdma-sys"))]
#[test]
fn layout_against_rdma_sys() {
    println!(
        "skipped: built without the `rdma-sys` feature; run \
         `cargo test -p ibverbx --features rdma-sys --test verbs_layout`"
    );
}

#[cfg(feature = "rdma-sys")]
mod with_rdma_sys {
    use std::mem::{align_of, offset_of, size_of};

    use ibverbx::verbs::ffi;
    use rdma_sys as sys;

    /// Same size and alignment, and each listed field (ours = theirs) at the
    /// same offset.
    macro_rules! same_layout {
        ($ours:ident, [$($a:ident = $b:ident),* $(,)?]) => {{
            assert_eq!(size_of::<ffi::$ours>(), size_of::<sys::$ours>(), concat!("size of ", stringify!($ours)));
            assert_eq!(align_of::<ffi::$ours>(), align_of::<sys::$ours>(), concat!("align of ", stringify!($ours)));
            $(
                assert_eq!(
                    offset_of!(ffi::$ours, $a),
                    offset_of!(sys::$ours, $b),
                    concat!(stringify!($ours), ".", stringify!($a))
                );
            )*
        }};
    }

    #[test]
    fn device_and_port() {
        same_layout!(
            ibv_device,
            [
                _ops = _ops,
                node_type = node_type,
                name = name,
                dev_name = dev_name,
                dev_path = dev_path,
                ibdev_path = ibdev_path
            ]
        );
        same_layout!(
            ibv_device_attr,
            [
                fw_ver = fw_ver,
                node_guid = node_guid,
                max_mr_size = max_mr_size,
                max_qp = max_qp,
                max_qp_wr = max_qp_wr,
                device_cap_flags = device_cap_flags,
                max_sge = max_sge,
                max_cqe = max_cqe,
                max_mr = max_mr,
                max_qp_rd_atom = max_qp_rd_atom,
                max_qp_init_rd_atom = max_qp_init_rd_atom,
                atomic_cap = atomic_cap,
                max_srq_sge = max_srq_sge,
                max_pkeys = max_pkeys,
                local_ca_ack_delay = local_ca_ack_delay,
                phys_port_cnt = phys_port_cnt
            ]
        );
        same_layout!(
            ibv_port_attr,
            [
                state = state,
                max_mtu = max_mtu,
                active_mtu = active_mtu,
                gid_tbl_len = gid_tbl_len,
                max_msg_sz = max_msg_sz,
                lid = lid,
                active_width = active_width,
                active_speed = active_speed,
                link_layer = link_layer,
                flags = flags,
                port_cap_flags2 = port_cap_flags2
            ]
        );
        same_layout!(ibv_gid, [raw = raw]);
        same_layout!(
            ibv_gid_entry,
            [gid = gid, gid_index = gid_index, port_num = port_num, gid_type = gid_type, ndev_ifindex = ndev_ifindex]
        );
    }

    #[test]
    fn context_and_ops_table() {
        same_layout!(
            ibv_context,
            [
                device = device,
                ops = ops,
                cmd_fd = cmd_fd,
                async_fd = async_fd,
                num_comp_vectors = num_comp_vectors,
                mutex = mutex,
                abi_compat = abi_compat
            ]
        );
        same_layout!(
            ibv_context_ops,
            [
                alloc_mw = alloc_mw,
                poll_cq = poll_cq,
                req_notify_cq = req_notify_cq,
                post_srq_recv = post_srq_recv,
                post_send = post_send,
                post_recv = post_recv,
                _compat_async_event = _compat_async_event
            ]
        );
    }

    #[test]
    fn objects() {
        same_layout!(ibv_pd, [context = context, handle = handle]);
        same_layout!(
            ibv_mr,
            [context = context, pd = pd, addr = addr, length = length, handle = handle, lkey = lkey, rkey = rkey]
        );
        same_layout!(ibv_comp_channel, [context = context, fd = fd, refcnt = refcnt]);
        same_layout!(
            ibv_cq,
            [
                context = context,
                channel = channel,
                cq_context = cq_context,
                handle = handle,
                cqe = cqe,
                mutex = mutex,
                cond = cond,
                comp_events_completed = comp_events_completed,
                async_events_completed = async_events_completed
            ]
        );
        same_layout!(
            ibv_qp,
            [
                context = context,
                qp_context = qp_context,
                pd = pd,
                send_cq = send_cq,
                recv_cq = recv_cq,
                srq = srq,
                handle = handle,
                qp_num = qp_num,
                state = state,
                qp_type = qp_type,
                mutex = mutex,
                cond = cond,
                events_completed = events_completed
            ]
        );
    }

    #[test]
    fn qp_attributes() {
        same_layout!(
            ibv_qp_cap,
            [
                max_send_wr = max_send_wr,
                max_recv_wr = max_recv_wr,
                max_send_sge = max_send_sge,
                max_recv_sge = max_recv_sge,
                max_inline_data = max_inline_data
            ]
        );
        same_layout!(
            ibv_qp_init_attr,
            [
                qp_context = qp_context,
                send_cq = send_cq,
                recv_cq = recv_cq,
                srq = srq,
                cap = cap,
                qp_type = qp_type,
                sq_sig_all = sq_sig_all
            ]
        );
        same_layout!(
            ibv_global_route,
            [
                dgid = dgid,
                flow_label = flow_label,
                sgid_index = sgid_index,
                hop_limit = hop_limit,
                traffic_class = traffic_class
            ]
        );
        same_layout!(
            ibv_ah_attr,
            [
                grh = grh,
                dlid = dlid,
                sl = sl,
                src_path_bits = src_path_bits,
                static_rate = static_rate,
                is_global = is_global,
                port_num = port_num
            ]
        );
        same_layout!(
            ibv_qp_attr,
            [
                qp_state = qp_state,
                cur_qp_state = cur_qp_state,
                path_mtu = path_mtu,
                path_mig_state = path_mig_state,
                qkey = qkey,
                rq_psn = rq_psn,
                sq_psn = sq_psn,
                dest_qp_num = dest_qp_num,
                qp_access_flags = qp_access_flags,
                cap = cap,
                ah_attr = ah_attr,
                alt_ah_attr = alt_ah_attr,
                pkey_index = pkey_index,
                alt_pkey_index = alt_pkey_index,
                en_sqd_async_notify = en_sqd_async_notify,
                sq_draining = sq_draining,
                max_rd_atomic = max_rd_atomic,
                max_dest_rd_atomic = max_dest_rd_atomic,
                min_rnr_timer = min_rnr_timer,
                port_num = port_num,
                timeout = timeout,
                retry_cnt = retry_cnt,
                rnr_retry = rnr_retry,
                alt_port_num = alt_port_num,
                alt_timeout = alt_timeout,
                rate_limit = rate_limit
            ]
        );
    }

    #[test]
    fn data_path() {
        same_layout!(ibv_sge, [addr = addr, length = length, lkey = lkey]);
        same_layout!(ibv_recv_wr, [wr_id = wr_id, next = next, sg_list = sg_list, num_sge = num_sge]);
        same_layout!(
            ibv_send_wr,
            [
                wr_id = wr_id,
                next = next,
                sg_list = sg_list,
                num_sge = num_sge,
                opcode = opcode,
                send_flags = send_flags,
                imm_data = imm_data_invalidated_rkey_union,
                wr = wr,
                qp_type = qp_type,
                bind_mw = bind_mw_tso_union
            ]
        );
        assert_eq!(offset_of!(ffi::ibv_send_wr_atomic, rkey), offset_of!(sys::atomic_t, rkey));
        assert_eq!(offset_of!(ffi::ibv_send_wr_atomic, swap), offset_of!(sys::atomic_t, swap));
        assert_eq!(offset_of!(ffi::ibv_send_wr_rdma, rkey), offset_of!(sys::rdma_t, rkey));
        same_layout!(
            ibv_wc,
            [
                wr_id = wr_id,
                status = status,
                opcode = opcode,
                vendor_err = vendor_err,
                byte_len = byte_len,
                imm_data = imm_data_invalidated_rkey_union,
                qp_num = qp_num,
                src_qp = src_qp,
                wc_flags = wc_flags,
                pkey_index = pkey_index,
                slid = slid,
                sl = sl,
                dlid_path_bits = dlid_path_bits
            ]
        );
    }
}
